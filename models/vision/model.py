"""`VisionLanguageModel`: a megatron GPTModel that takes images.

Forward contract (models.vision.inputs.VisionBatch, `vision=` keyword; None: text only, the
plain GPTModel forward):
- every pipeline stage rotates queries and keys by `vision.positions` (models.vision.rope);
- the first stage embeds the tokens as GPTModel does (its word embeddings, then the sequence-
  parallel scatter), runs the tower on `vision.images` (models.vision.tower) and puts feature
  row `feature_rows[b, t]` in place of each placeholder token's embedding. Under CP each rank
  holds its zigzag chunks of the tokens and of `feature_rows`, and the tower's output for all
  images of the micro-batch: images are embedded before the sequence is split, in effect.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from models.vision.inputs import VisionBatch
from models.vision.rope import MultimodalRotary
from models.vision.spec import VisionSpec
from models.vision.tower import image_features


class VisionLanguageModel(GPTModel):
    """GPTModel + vision tower (first stage) + M-RoPE (every stage); see the module docstring.
    `tower`: built by models.vision.tower.build_tower (ignored off the first stage)."""

    def __init__(self, *args, vision_spec: VisionSpec, tower: torch.nn.Module | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.vision_spec = vision_spec
        self.rotary_pos_emb = MultimodalRotary(self.rotary_pos_emb, vision_spec.mrope_section)
        self.vision = tower if self.pre_process else None

    def forward(self, input_ids, position_ids, attention_mask, *args,
                vision: VisionBatch | None = None, decoder_input=None, **kwargs):
        if vision is None:
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   decoder_input=decoder_input, **kwargs)
        self.rotary_pos_emb.positions = vision.positions
        try:
            if self.pre_process and decoder_input is None and vision.images is not None:
                decoder_input = self._embed_with_images(input_ids, position_ids, vision)
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   decoder_input=decoder_input, **kwargs)
        finally:
            self.rotary_pos_emb.positions = None

    def _embed_with_images(self, input_ids, position_ids, vision: VisionBatch) -> torch.Tensor:
        """[s (/ tp with SP), b, h]: the token embeddings with image features in place."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        features = image_features(self.vision, vision.images.pixel_values,
                                  vision.images.grid_thw).to(emb.dtype)
        rows = vision.feature_rows.transpose(0, 1)           # [s, b] like emb
        if self.config.sequence_parallel:                    # this rank's sequence shard
            tp = ps.get_tensor_model_parallel_world_size()
            rows = rows.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
        if int(rows.max()) >= features.shape[0]:
            raise ValueError(f"a placeholder token takes image feature row {int(rows.max())}, "
                             f"the tower gave {features.shape[0]} rows")
        picked = features[rows.clamp(min=0)]                 # [s, b, h]
        # where() may keep the transposed rows' strides; megatron's p2p sends need [s, b, h]
        return torch.where((rows >= 0)[..., None], picked, emb).contiguous()
