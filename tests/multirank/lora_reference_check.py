"""The reference after a LoRA start at a layout (used by tests/multirank/lora_check.py).

A run from a PEFT adapter (model.lora.init_from) has that starting adapter, frozen, as its
reference (DPO, KTO: engine.preference.reference; RL's KL reference:
engine.rl.policy.logprob_stage.lora_reference_logprobs, called here). `logprobs(engine, seqs)`
before training, then `reference_report` after it (or after a resume, with `before` from a run
of the same layout) gives the largest |difference| over the trained tokens of:
- `ref_gap`: the reference's log-probs (the adapter loaded from its folder into the policy's
  reference matrices, swapped in for a forward-only pass) against the policy's before training;
- `moved` (negative control): the trained policy's against the same: what the current adapter
  as reference (rebuilt from a checkpoint) would give;
- `base_gap` (negative control, with `base`): the bare base's (adapters off) against the same;
- `report_s`: the wall time of the report's passes (the adapter's loading included).
Collective over the world (every rank calls it with the same arguments).
"""
from __future__ import annotations

import time


def logprobs(engine, seqs):
    """The policy's token log-probs (temperature 1) of `seqs`' trained tokens, 1-D float32."""
    import torch

    from engine.rl.policy.logprobs import compute_token_logprobs

    return _trained(compute_token_logprobs(engine, seqs, 1.0), seqs, torch)


def _trained(table, seqs, torch):
    width = table.shape[1]
    keep = torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for s in seqs],
                        dtype=torch.bool)
    return table[keep]


def reference_report(engine, seqs, adapter: str, before, base: bool = False) -> dict:
    import torch

    from engine.rl.policy.logprob_stage import base_logprobs, lora_reference_logprobs

    gap = lambda a: float((a - before).abs().max())
    t0 = time.perf_counter()
    reference = _trained(lora_reference_logprobs(engine, seqs, 1.0, adapter), seqs, torch)
    out = {"ref_gap": gap(reference), "moved": gap(logprobs(engine, seqs))}
    if base:
        out["base_gap"] = gap(_trained(base_logprobs(engine, seqs, 1.0), seqs, torch))
    out["report_s"] = time.perf_counter() - t0   # the report's passes (load included)
    return out
