"""megatron's MTP layer fed with the micro-batch's next tokens, optionally cut from the trunk.

megatron-core's `MultiTokenPredictionLayer` rolls `input_ids` itself (`roll_tensor`), which
needs CUDA with context parallelism and reads packed boundaries from `cu_seqlens_q`. The engine
instead builds the next token of every position on the host, before packing and the CP zigzag
cut (engine.training.mtp.mtp_targets), so `EngineMTPLayer` only embeds them. Everything else
(the norms, eh_proj, the transformer layer, the final norm, sequence/tensor parallelism) is
megatron's own code.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor


@dataclass
class MTPInputs:
    """What one forward pass gives the MTP block (set by engine.training.mtp on the model).

    `next_ids`: [b, s_local] long, the token after each position of this CP shard (0 where the
    sequence ends; those positions carry no MTP target). `detach`: cut the MTP path from the
    trunk: the trunk's hidden states, the embedding and the output head get no gradient from
    the MTP loss (RL: the policy gradient stays exactly the policy's). `hidden`: filled by the
    forward, the MTP block's output [b, s, h] as the output layer's input (replicated over TP,
    models.layers.heads.output)."""

    next_ids: torch.Tensor | None = None
    detach: bool = False
    hidden: torch.Tensor | None = None


class EngineMTPLayer(MultiTokenPredictionLayer):
    """MultiTokenPredictionLayer whose next-token embeddings come from `MTPInputs.next_ids`
    (the owning model's `mtp_inputs`, attached as `self.inputs` by models.layers.mtp.model)."""

    inputs: MTPInputs | None = None

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states,
                        packed_seq_params=None, padding_mask=None):
        """megatron's (input_ids, position_ids, decoder_input, hidden_states), and with
        megatron-core >= 0.19 (whose layer passes `padding_mask`) (input_ids, position_ids,
        padding_mask, decoder_input, hidden_states): the next tokens instead of the rolled
        input ids; the padding mask unchanged (position t's padding is the token's own)."""
        state = self.inputs
        if state is None or state.next_ids is None:
            raise RuntimeError("the MTP layer ran without next-token ids: run it through "
                               "engine.training.mtp (TrainEngine with model.mtp.enabled)")
        next_ids = state.next_ids
        if state.detach:
            weight = embedding.word_embeddings.weight
            decoder_input = torch.func.functional_call(
                embedding, {"word_embeddings.weight": weight.detach()},
                kwargs=dict(input_ids=next_ids, position_ids=position_ids))
            hidden_states = hidden_states.detach()
        else:
            decoder_input = embedding(input_ids=next_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                             keep_graph=True)
        if not hidden_states.requires_grad:   # detached: recompute needs a grad-requiring input
            hidden_states.requires_grad_(True)
        if _PASSES_PADDING_MASK:
            return next_ids, position_ids, padding_mask, decoder_input, hidden_states
        return next_ids, position_ids, decoder_input, hidden_states


# megatron-core >= 0.19's MultiTokenPredictionLayer rolls and returns a padding mask too
_PASSES_PADDING_MASK = "padding_mask" in inspect.signature(
    MultiTokenPredictionLayer._get_embeddings).parameters
