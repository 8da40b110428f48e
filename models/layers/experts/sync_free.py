"""Megatron's all-to-all MoE token dispatch without host syncs where the numbers allow it.

Megatron-core 0.16 without Transformer Engine (no fused permutation) makes the host wait for the
GPU in every MoE layer of every micro-batch:
- `moe_utils.permute` groups the (token, expert) pairs by expert with two `masked_select`s (the
  token indices and the routing probabilities), whose output size the host must read back;
- the all-to-all dispatcher copies the token counts per expert to the host and waits for them
  (`_maybe_dtoh_and_synchronize`), and at tp x ep = 1 splits the expert-sorted tokens into
  per-expert chunks and concatenates them in the same order (`sort_chunks_by_idxs`, twice: a
  copy of every routed token that changes nothing).

`permute` orders the pairs by a stable argsort of the expert-major routing map instead: the
pairs come out in exactly masked_select's order (expert by expert, tokens ascending), so the
permuted tokens, probabilities and indices are the same tensors; the output size is the static
tokens x top-k that megatron's dropless dispatcher already passes as `num_out_tokens` (a Python
int; every row of a dropless top-k routing map holds exactly top-k experts). Token dropping,
capacity padding, router padding for quantization and the fused (TE) path keep megatron's code.

`SyncFreeAlltoAllDispatcher` (megatron's MoEAlltoAllTokenDispatcher) at expert tp x ep = 1,
dropless, unfused: the counts per expert stay on the device (the grouped experts take them as
`torch._grouped_mm` offsets: models.layers.experts.grouped) and the identity chunk sort is
skipped. Any other layout runs megatron's methods unchanged: with ep or expert-tp > 1 the
all-to-all sizes must be on the host (one sync per layer, megatron's). Consumers that need host
counts read them themselves: SequentialMLP's forward and the padded-bmm fallback of the grouped
experts call `.tolist()` (one sync per layer on those paths only).

`install_permute()` points megatron's dispatcher module at `permute`, `install_dispatcher()` its
MoE layer at `SyncFreeAlltoAllDispatcher` (both idempotent); models.build.megatron_patches
applies them (entries `moe_argsort_permute`, `moe_sync_free_dispatcher`). Megatron-core >= 0.17
ships the argsort permutation itself (its `permute` takes `tokens_per_expert` and answers five
values): there `permute` stays megatron's (the registry's version range; this module's
`MEGATRON_PERMUTE_IS_SYNC_FREE` says the same from the signature), and only the dispatcher is
replaced. Megatron-core >= 0.18 starts the shared experts' fc1 in `token_dispatch` instead of
`dispatch_postprocess`: the local path does it where megatron's own method does
(`SHARED_FC1_IN_POSTPROCESS`), never twice.
"""
from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

_MEGATRON_PERMUTE = moe_utils.permute
# megatron-core >= 0.17: argsort-based, five results (pad offsets, padded counts) - keep it.
MEGATRON_PERMUTE_IS_SYNC_FREE = "tokens_per_expert" in inspect.signature(_MEGATRON_PERMUTE).parameters
# megatron-core 0.16-0.17 start the shared experts' fc1 in dispatch_postprocess, >= 0.18 earlier
SHARED_FC1_IN_POSTPROCESS = ("linear_fc1_forward_and_act"
                             in inspect.getsource(MoEAlltoAllTokenDispatcher.dispatch_postprocess))


def argsort_permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None,
                    num_out_tokens: int):
    """megatron's unfused, undropped `permute`: (tokens [N, H] grouped by expert, their
    probabilities or None, the token index of each row), the pairs of the [N, E] routing map
    in expert-major order, without reading the map's True count back to the host."""
    num_tokens = routing_map.shape[0]
    expert_major = routing_map.bool().T.contiguous().view(-1)            # [E * N]
    order = torch.argsort(expert_major.to(torch.int8), descending=True, stable=True)
    order = order[:num_out_tokens]
    sorted_indices = torch.remainder(order, num_tokens)
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.T.contiguous().view(-1).index_select(0, order)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
            drop_and_pad=False):
    """Drop-in for megatron's `moe_utils.permute` (same arguments and results): the argsort
    order when unfused, not drop-and-pad, and `num_out_tokens` a host int; else megatron's."""
    if fused or drop_and_pad or type(num_out_tokens) is not int:
        return _MEGATRON_PERMUTE(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                                 fused=fused, drop_and_pad=drop_and_pad)
    return argsort_permute(tokens, routing_map, probs, num_out_tokens)


class SyncFreeAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher; at expert tp x ep = 1, dropless and unfused, its
    counts per expert stay on the device and the identity chunk sort is skipped (module
    docstring). `local_only` says whether this instance takes that path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.local_only = (self.tp_size * self.ep_size == 1 and not self.drop_and_pad
                           and cfg.moe_expert_capacity_factor is None
                           and not cfg.moe_router_padding_for_quantization
                           and not cfg.moe_permute_fusion)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.local_only:
            return tokens_per_expert
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self.local_only:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if SHARED_FC1_IN_POSTPROCESS and self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self.local_only:
            return super().combine_preprocess(hidden_states)
        return hidden_states


permute.megatron_original = _MEGATRON_PERMUTE   # what models.build.megatron_probes checks
SyncFreeAlltoAllDispatcher.megatron_original = MoEAlltoAllTokenDispatcher


def install_permute() -> None:
    """Idempotent: megatron's all-to-all dispatch permutes with `permute` (megatron-core 0.16;
    the registry keeps megatron's own, sync-free one from 0.17)."""
    token_dispatcher.permute = permute


def install_dispatcher() -> None:
    """Idempotent: megatron's MoE layers build `SyncFreeAlltoAllDispatcher`."""
    moe_layer.MoEAlltoAllTokenDispatcher = SyncFreeAlltoAllDispatcher
