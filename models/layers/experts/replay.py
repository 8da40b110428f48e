"""Record and replay the top-k expert choice of megatron's MoE routers (routing replay, R2/R3).

Megatron-Core's `topk_routing_with_score_function` asks the router's `router_replay` object
(when not None) for the top-k: `get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk) -> (values, indices)`. `ReplaySlot` is that object, one per router,
attached after the model is built (`attach_slots`): no layer-spec change, and the whole
routing path (z-loss, aux losses, token dispatch) stays megatron's.

Modes of a slot:
- None: megatron's own top-k, untouched.
- "record": megatron's own top-k; the indices [tokens, k] go to `sink(layer_number, indices)`.
- "replay": the indices are the target set for this forward (`set_target`), on tokens whose
  `valid` flag is set (padding keeps the router's own choice). The values are the scores
  gathered at the replayed experts, so the routing weights are recomputed from the current
  router: with megatron's `moe_router_pre_softmax=False` (renormalising families: Qwen3-MoE
  with norm_topk_prob, Mixtral) a softmax over the k replayed logits, with
  `pre_softmax=True` the full softmax's probabilities of the replayed experts; gradients flow
  into the router through these weights exactly as without replay (verl's router replay and
  slime's routing replay gather the same way).

Recomputation (train.recompute=full): megatron's checkpoint runs a layer first without
autograd and again inside the backward pass, when other micro-batches may already have set
their targets. A replaying slot therefore queues the target of every no-grad call; a
grad-enabled call with a queued target is a recompute and takes the oldest (backward runs the
micro-batches of a chunk in forward order). `reset()` clears the queue before each run.

Mismatch counting: in replay mode every first (non-recompute) call compares, per valid token,
the router's own top-k set with the replayed set; `counts` = [tokens that differ, valid
tokens] (float64; a token weighted by `set_target`'s weight: a prefix tree's node counts the
rows' tokens it stands for), read and cleared by the caller (engine.training.routing).
"""
from __future__ import annotations

import inspect
from collections import deque
from typing import Callable

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

MODES = (None, "record", "replay")


class ReplaySlot:
    """The `router_replay` object megatron's TopKRouter consults (module docstring)."""

    def __init__(self, layer_number: int, topk: int):
        self.layer_number = layer_number  # global, 1-based (megatron's router.layer_number)
        self.topk = topk
        self.mode: str | None = None
        self.sink: Callable[[int, torch.Tensor], None] | None = None
        self.counting = True                 # add to `counts` (False on TP duplicates)
        self.target: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending: deque = deque()
        self.counts = torch.zeros(2, dtype=torch.float64)
        self.calls = 0                       # replaying consultations since reset()

    def reset(self) -> None:
        self.target = None
        self.pending.clear()
        self.counts.zero_()
        self.calls = 0

    def set_target(self, indices: torch.Tensor, valid: torch.Tensor,
                   weight: torch.Tensor | None = None) -> None:
        """indices [tokens, k] (long), valid [tokens] (bool): this forward's routing, tokens
        in the router's order (sequence-major, this rank's sequence-parallel slice).
        `weight` [tokens] (float64): how many tokens each one counts for in `counts` (a prefix
        tree's node: the rows' tokens it stands for); default 1 on valid tokens."""
        self.target = (indices, valid, valid.to(torch.float64) if weight is None else weight)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                               group_topk=group_topk)
        if self.mode is None:
            return own_values, own
        if self.mode == "record":
            if self.sink is not None:
                self.sink(self.layer_number, own.detach())
            return own_values, own
        return self._replay(scores, own)

    def _replay(self, scores: torch.Tensor, own: torch.Tensor):
        if self.target is None:
            raise RuntimeError(f"routing replay: MoE layer {self.layer_number} ran without a "
                               "replay target (the micro-batch carried no routed experts)")
        recompute = torch.is_grad_enabled() and bool(self.pending)
        if recompute:
            indices, valid, weight = self.pending.popleft()
        else:
            indices, valid, weight = self.target
            if not torch.is_grad_enabled():
                self.pending.append(self.target)
        if indices.shape != own.shape:
            raise RuntimeError(f"routing replay: MoE layer {self.layer_number} routes "
                               f"{tuple(own.shape)} token choices, the replay target has "
                               f"{tuple(indices.shape)}")
        indices = indices.to(own.device)
        valid = valid.to(own.device)
        chosen = torch.where(valid[:, None], indices, own)
        if not recompute:
            self.calls += 1
            if self.counting:
                differs = (chosen.sort(dim=1).values != own.sort(dim=1).values).any(dim=1)
                weight = torch.where(valid.cpu(), weight.cpu(), 0.0)
                self.counts += torch.stack([(weight * differs.cpu()).sum(), weight.sum()])
        return scores.gather(1, chosen), chosen


def replay_supported() -> str | None:
    """None when this megatron-core lets a router's `router_replay` choose the top-k, else why
    not."""
    params = inspect.signature(moe_utils.topk_routing_with_score_function).parameters
    if "router_replay" not in params:
        return ("this megatron-core's topk_routing_with_score_function takes no router_replay "
                "(routing replay needs megatron-core >= 0.16)")
    return None


def attach_slots(chunks: list) -> dict[int, list[ReplaySlot]]:
    """Give every TopKRouter of `chunks` (megatron modules, DDP-wrapped or not) a ReplaySlot;
    returns {chunk index: its slots}. Raises RuntimeError when megatron would bypass the slot
    (no replay hook in this version, or the fused TE router)."""
    problem = replay_supported()
    if problem:
        raise RuntimeError(f"moe.routing_replay: {problem}")
    out: dict[int, list[ReplaySlot]] = {}
    for i, chunk in enumerate(chunks):
        slots = []
        for module in chunk.modules():
            if not isinstance(module, TopKRouter):
                continue
            if getattr(module.config, "moe_router_fusion", False):
                raise RuntimeError("moe.routing_replay: megatron's fused router "
                                   "(moe_router_fusion) bypasses the replay hook")
            slot = ReplaySlot(int(module.layer_number), int(module.topk))
            module.router_replay = slot
            slots.append(slot)
        out[i] = slots
    return out
