"""GPTModel with megatron's MTP block whose output goes to the engine's loss head.

megatron-core's GPTModel computes the MTP loss inside `_postprocess` (labels required, averaged
per micro-batch, logged through a global tracker). The engine computes every loss outside the
model with globally fixed per-token weights (engine.training.loss), so `MTPGPTModel` runs the
MTP block only while its `mtp_inputs.next_ids` is set (training steps: engine.training.mtp),
stores the block's output in `mtp_inputs.hidden` as the output layer's input ([b, s, h],
replicated over TP exactly as the chunked loss head receives the main hidden states:
models.layers.heads.output.tp_replicated_input) and returns what GPTModel returns for the main
hidden states. Forward-only passes (evaluation, RL log-probs) skip the block.
"""
from __future__ import annotations

import contextlib
import inspect

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

from models.layers.heads.output import tp_replicated_input
from models.layers.mtp.layer import MTPInputs


@contextlib.contextmanager
def _no_internal_mtp_loss(config):
    """GPTModel._postprocess computes megatron's own MTP loss when config.mtp_num_layers is
    set; the engine's loss head replaces it (the MTP block already ran)."""
    layers = config.mtp_num_layers
    config.mtp_num_layers = None
    try:
        yield
    finally:
        config.mtp_num_layers = layers


class MTPGPTModel(GPTModel):
    """A GPTModel built with `mtp_block_spec` (models.layers.mtp.spec); on the last pipeline
    stage it holds the MTP block and a copy of the embedding (megatron ties it to the first
    stage's: their gradients are summed over the embedding group by finalize_model_grads)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mtp_inputs = MTPInputs()
        if self.mtp_process:
            for layer in self.mtp.layers:
                layer.inputs = self.mtp_inputs

    def _postprocess(self, hidden_states, *args, **kwargs):
        """GPTModel._postprocess of the installed megatron-core (its arguments bound by name:
        they differ between releases) with the MTP block run here, its output stored in
        `mtp_inputs.hidden`, and the main hidden states passed on."""
        state = self.mtp_inputs
        state.hidden = None
        bound = _POSTPROCESS.bind(self, hidden_states, *args, **kwargs).arguments
        bound.pop("self")
        if bound.get("mtp_in_postprocess") and state.next_ids is not None:
            inputs = {k: bound.get(k) for k in _MTP_INPUTS}
            inputs.update(bound.get("extra_block_kwargs") or {})
            both = self.mtp(hidden_states=hidden_states, embedding=self.embedding, **inputs)
            bound["hidden_states"], mtp_hidden = both.chunk(2, dim=0)
            state.hidden = tp_replicated_input(self.output_layer, mtp_hidden).transpose(0, 1)
        bound["mtp_in_postprocess"] = False
        with _no_internal_mtp_loss(self.config):
            return super()._postprocess(**bound)


_POSTPROCESS = inspect.signature(GPTModel._postprocess)
# what GPTModel._postprocess hands megatron's MTP block, of those this release's block takes
_MTP_INPUTS = tuple(n for n in ("input_ids", "position_ids", "attention_mask",
                                "inference_params", "rotary_pos_emb", "rotary_pos_cos",
                                "rotary_pos_sin", "packed_seq_params", "sequence_len_offset",
                                "padding_mask")
                    if n in _POSTPROCESS.parameters
                    and n in inspect.signature(MultiTokenPredictionBlock.forward).parameters)
