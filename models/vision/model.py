"""`VisionLanguageModel`: a megatron GPTModel that takes images.

Forward contract (models.vision.inputs.VisionBatch, `vision=` keyword; None: text only, the
plain GPTModel forward):
- every pipeline stage rotates queries and keys by `vision.positions` (models.vision.rope);
- the first stage embeds the tokens as GPTModel does (its word embeddings, then the sequence-
  parallel scatter), runs the tower on `vision.images` (models.vision.tower) and puts feature
  row `feature_rows[b, t]` in place of each placeholder token's embedding. Under CP each rank
  holds its zigzag chunks of the tokens and of `feature_rows`, and the tower's output for all
  images of the micro-batch: images are embedded before the sequence is split, in effect.
  `feature_rows` index the tower's output by construction (models.vision.inputs.
  SequenceVision.of refuses placeholders that do not match their images' grids), so the
  forward pass checks nothing on the device;
- deepstack (Qwen3-VL): the tower's k-th intermediate feature set is added to the output of
  decoder layer k at the same rows (a forward hook on layers 0 .. deepstack_layers - 1), as
  transformers' `_deepstack_process` does after each of those layers. Those layers must be
  on the first pipeline stage, with the tower, and full recomputation is refused with
  deepstack: megatron recomputes a layer in the backward pass after this forward's features
  are gone (both refused at build);
- a trained tower runs on every micro-batch that computes gradients: one without images adds
  the tower's zero pass (models.vision.tower.zero_pass: exactly 0.0, every tower parameter
  gets an all-zero gradient) to its embeddings, so that megatron's overlapped gradient
  reduction finds the tower's gradients in every last micro-batch, as in the first step (a
  rank whose last micro-batch had images in one step and none in another never launched the
  reduction of the tower's bucket).

`MTPVisionLanguageModel` adds the trained MTP layer (models.layers.mtp.model.MTPGPTModel's
`_postprocess`) to the same model: a published Qwen3.5 conditional-generation checkpoint
trained with model.mtp.enabled. The MTP layer reads the trunk's final hidden states (image
rows included) and the plain token embedding of the next token (an image placeholder's own
embedding row, as megatron's MTP layer embeds it; such targets sit in the untrained prompt),
and rotates by the main model's M-RoPE positions of its own position t, as vLLM's Qwen3.5 MTP
drafter is given the target's positions.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from models.layers.mtp.model import MTPGPTModel
from models.vision.inputs import VisionBatch
from models.vision.rope import MultimodalRotary
from models.vision.spec import VisionSpec
from models.vision.tower import image_features, zero_pass


class VisionLanguageModel(GPTModel):
    """GPTModel + vision tower (first stage) + M-RoPE (every stage); see the module docstring.
    `tower`: built by models.vision.tower.build_tower (ignored off the first stage)."""

    def __init__(self, *args, vision_spec: VisionSpec, tower: torch.nn.Module | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.vision_spec = vision_spec
        self.rotary_pos_emb = MultimodalRotary(self.rotary_pos_emb, vision_spec.mrope_section)
        self.vision = tower if self.pre_process else None
        self._deepstack: tuple[list[torch.Tensor], torch.Tensor] | None = None
        if vision_spec.deepstack_layers and self.config.recompute_granularity == "full":
            raise ValueError("train.recompute=full is not supported with deepstack image "
                             "features (Qwen3-VL): a recomputed layer would not see them; use "
                             "train.recompute=selective or none")
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < vision_spec.deepstack_layers:
                if not self.pre_process:
                    raise ValueError(
                        f"decoder layer {layer.layer_number - 1} receives deepstack image "
                        f"features (the first {vision_spec.deepstack_layers} layers do) but is "
                        "not on the first pipeline stage, which runs the vision tower; give the "
                        "first stage more layers or lower parallel.pp")
                layer.register_forward_hook(self._add_deepstack)

    def forward(self, input_ids, position_ids, attention_mask, *args,
                vision: VisionBatch | None = None, decoder_input=None, **kwargs):
        images = None if vision is None else vision.images
        if self.pre_process and decoder_input is None:
            if images is not None:
                decoder_input = self._embed_with_images(input_ids, position_ids, vision)
            elif self._tower_needs_zero_pass():
                decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
                decoder_input = decoder_input + zero_pass(self.vision, self.vision_spec).to(
                    decoder_input.dtype)
            if decoder_input is not None:   # built here: megatron leaves the mask whole
                kwargs = self._shard_padding_mask(kwargs)
        if vision is None:
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   decoder_input=decoder_input, **kwargs)
        self.rotary_pos_emb.positions = vision.positions
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   decoder_input=decoder_input, **kwargs)
        finally:
            self.rotary_pos_emb.positions = None
            self._deepstack = None

    def _shard_padding_mask(self, kwargs: dict) -> dict:
        """kwargs with the MoE routers' `padding_mask` [b, s] cut to this TP rank's sequence
        shard [b, s/tp] under sequence parallelism. Megatron's GPTModel scatters the mask only
        when it embeds the tokens itself; this model may hand it a decoder_input it built (with
        images, or the tower's zero pass), and megatron then leaves the mask whole."""
        mask = kwargs.get("padding_mask")
        if mask is None or not self.config.sequence_parallel:
            return kwargs
        tp = ps.get_tensor_model_parallel_world_size()
        shard = mask.chunk(tp, dim=1)[ps.get_tensor_model_parallel_rank()].contiguous()
        return {**kwargs, "padding_mask": shard}

    def _tower_needs_zero_pass(self) -> bool:
        """A micro-batch without images, the tower trained and gradients on: run the tower's
        zero pass (models.vision.tower.zero_pass) so that every tower parameter gets its
        (zero) gradient, which the overlapped gradient reduction waits for."""
        return (self.vision is not None and torch.is_grad_enabled()
                and next(self.vision.parameters()).requires_grad)

    def _embed_with_images(self, input_ids, position_ids, vision: VisionBatch) -> torch.Tensor:
        """[s (/ tp with SP), b, h]: the token embeddings with image features in place."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        features, deepstack = image_features(self.vision, vision.images.pixel_values,
                                             vision.images.grid_thw)
        rows = vision.feature_rows.transpose(0, 1)           # [s, b] like emb
        if self.config.sequence_parallel:                    # this rank's sequence shard
            tp = ps.get_tensor_model_parallel_world_size()
            rows = rows.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
        if deepstack:
            self._deepstack = ([d.to(emb.dtype) for d in deepstack], rows)
        return _place(emb, features.to(emb.dtype), rows)

    def _add_deepstack(self, layer, inputs, output):
        """Forward hook of decoder layers 0 .. deepstack_layers - 1 (module docstring)."""
        if self._deepstack is None:
            return output
        features, rows = self._deepstack
        hidden, *rest = output if isinstance(output, tuple) else (output,)
        added = hidden + _place(torch.zeros_like(hidden), features[layer.layer_number - 1], rows)
        return (added, *rest) if isinstance(output, tuple) else added


class MTPVisionLanguageModel(VisionLanguageModel, MTPGPTModel):
    """VisionLanguageModel whose last stage also runs the MTP block (module docstring). The
    method resolution order VisionLanguageModel -> MTPGPTModel -> GPTModel keeps each part's
    contract: the vision forward wraps GPTModel.forward, whose `_postprocess` is MTPGPTModel's."""


def _place(base: torch.Tensor, features: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`base` [s, b, h] with row rows[s, b] of `features` where rows >= 0."""
    picked = features[rows.clamp(min=0)]
    # where() may keep the transposed rows' strides; megatron's p2p sends need [s, b, h]
    return torch.where((rows >= 0)[..., None], picked, base).contiguous()
