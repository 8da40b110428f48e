"""Prefix sharing with MoE routing replay (train.prefix_sharing + moe.routing_replay) against
the unshared rows, on the same batches (launched by tests/test_prefix_sharing_replay.py).

    torchrun --nproc_per_node W tests/multirank/prefix_replay_check.py MOE_MODEL_DIR SPEC...

SPEC as in tests/multirank/prefix_sharing_check.py ("tp,pp,cp[,flags]": sp, mbs=N, ep=N, ctl).
Per spec, sharing off then on, the same HF weights loaded each time, on that harness's GRPO
batch (3 prompts x 4 replies; in group 0 a reply extending another and a duplicate):
  1. R2 record: the old-log-prob forward records every token's top-k per MoE layer;
  2. the recording made to DIVERGE where rows share tokens, as a rollout engine's or another
     layout's recording may: in group 0, reply 1's routing of layer 1 from prompt position 5
     on, and the duplicate reply 3's at its last token, moved to other experts;
  3. R3-style: the log-probs recomputed replaying that routing (the table compared);
  4. STEPS GRPO updates replaying it (every metric compared; moe/replay_mismatch too).
Rank 0 prints "RESULT {json}" per spec: the harness's compare() plus "recorded_diff", the
fraction of (token, layer-choice) entries where the two runs' step-1 recordings differ, and
"mismatch_rel", moe/replay_mismatch's largest relative difference (with its values).
Controls (ctl), shared runs with a piece broken ("CONTROL {json}"):
  unkeyed:  the trie keyed by tokens only, so rows whose recorded routings differ share a node
            (which replays one of them);
  per_node: the replay mismatch counted once per tree node instead of per row token;
  first_row: the recording pass writes a node's choice to its first row only.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.multirank.prefix_sharing_check import (SETTINGS, STEPS, _engine,  # noqa: E402
                                                  compare, grpo_rollout, parse_spec)

CONTROLS = ("unkeyed", "per_node", "first_row")


def diverge(recorded, batch, topk: int, num_experts: int):
    """The recorded table [rows, len, layers * k] with group 0's shared tokens made to disagree
    (module docstring, step 2): experts shifted by 3 (distinct within a token's top-k)."""
    out = recorded.clone()
    prompt = len(batch.prompt_ids[0])
    out[1, 5:prompt, :topk] = (out[1, 5:prompt, :topk] + 3) % num_experts
    last = prompt + len(batch.response_ids[3]) - 2   # the duplicate's last token (labels shift)
    out[3, last, :topk] = (out[3, last, :topk] + 3) % num_experts
    return out


def grpo_replay_run(model_dir, hf_config, layout_kw, world, train, sp):
    """(table, steps, recorded, mismatch of the replaying log-prob pass): steps 1-4 of the
    module docstring."""
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.rl.policy.routing_replay import attach_routing, end_replay, start_routing_replay
    from engine.rl.policy.update import PolicyLossSettings, policy_update
    from tests.multirank.rl_invariance import _sequences

    state = _engine(model_dir, hf_config, layout_kw, world, train, sp)
    routing = state.enable_routing_replay()
    batch = grpo_rollout(hf_config["vocab_size"])
    temperature = SETTINGS["temperature"]
    start_routing_replay(state, "R2")
    compute_token_logprobs(state, build_sequences(batch), temperature)
    recorded = routing.recorded()
    routing.set_mode("replay")
    diverged = diverge(recorded, batch, routing.topk, routing.num_experts)
    replaying = build_sequences(batch)
    attach_routing(replaying, diverged, routing.num_experts)
    table = compute_token_logprobs(state, replaying, temperature)
    logprob_mismatch = routing.mismatch()   # R3's moe/rollout_replay_mismatch
    seqs, table, _, _ = _sequences(state, batch, temperature, table=table)
    attach_routing(seqs, diverged, routing.num_experts)
    settings = PolicyLossSettings(vocab_size=state.vocab_size, **SETTINGS)
    loss_cfg = SimpleNamespace(agg_mode="token-mean", count_empty_sequences=True)
    steps = [policy_update(state, seqs, loss_cfg, settings, 40) for _ in range(STEPS)]
    end_replay(state)
    state.release()
    return table, steps, recorded, logprob_mismatch


def broken(kind: str):
    """A context manager that breaks routing replay on the tree the way a control needs."""
    import contextlib

    import torch

    import engine.training.rank_batch as rb
    import engine.training.tree_batch as tb

    @contextlib.contextmanager
    def patch():
        if kind == "unkeyed":   # trie of tokens only: diverging routings share a node
            saved = (tb.trie_rows, rb.trie_rows)
            tb.trie_rows = rb.trie_rows = lambda seqs: [list(s.tokens) for s in seqs]
            try:
                yield
            finally:
                tb.trie_rows, rb.trie_rows = saved
        else:   # per_node: a node's mismatch counted once, not once per row token;
            original = tb.tree_routing   # first_row: a node's choice recorded for one row only

            def changed(*args):
                out = original(*args)
                if kind == "per_node":
                    out.weight = (out.weight > 0).to(out.weight.dtype)
                    return out
                nodes = out.members[0]
                first = torch.zeros(nodes.numel(), dtype=torch.bool)
                seen = set()
                for i, n in enumerate(nodes.tolist()):
                    first[i] = n not in seen
                    seen.add(n)
                out.members = tuple(m[first] for m in out.members)
                return out
            tb.tree_routing = changed
            try:
                yield
            finally:
                tb.tree_routing = original
    return patch()


def _result(off, on) -> dict:
    out = compare(off[:2], on[:2])
    (r0, r1), key = (off[2], on[2]), "moe/replay_mismatch"
    real = r0.ne(0).any(dim=-1)   # recorded rows' real tokens (a real token's top-k is not all 0)
    out["recorded_diff"] = float((r0 != r1)[real].float().mean())
    values = [[s[key] for s in run[1]] for run in (off, on)]
    scale = max(max(abs(v) for v in values[0]), 1e-12)
    out["mismatch_rel"] = max(abs(a - b) for a, b in zip(*values)) / scale
    out["mismatch"] = values
    out["logprob_mismatch"] = [off[3], on[3]]
    return out


def main() -> None:
    import torch.distributed as dist

    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    _, world = init_distributed()
    model_dir = sys.argv[1]
    hf_config = read_config(model_dir)
    for spec in sys.argv[2:]:
        layout_kw, train_kw, sp, controls, _ = parse_spec(spec)
        off, on = (grpo_replay_run(model_dir, hf_config, layout_kw, world,
                                   SimpleNamespace(**train_kw, prefix_sharing=sharing), sp)
                   for sharing in (False, True))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"spec": spec, **_result(off, on)}), flush=True)
        for kind in CONTROLS if controls else ():
            with broken(kind):
                bad = grpo_replay_run(model_dir, hf_config, layout_kw, world,
                                      SimpleNamespace(**train_kw, prefix_sharing=True), sp)
            if dist.get_rank() == 0:
                print("CONTROL " + json.dumps({"spec": spec, "kind": kind,
                                               **_result(off, bad)}), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
