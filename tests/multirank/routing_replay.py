"""Multi-rank MoE routing replay harness (launched by tests/test_routing_replay.py).

    torchrun --nproc_per_node W tests/multirank/routing_replay.py MOE_MODEL_DIR SPEC...

Each SPEC is "tp,pp,cp,ep[,flags]" (flags "+" separated: sp, packing, budget: dynamic
micro-batches of at most 48 tokens, control: also run the negative control). On the fixed
synthetic rollout batch of tests/multirank/rl_invariance.py, for every spec (parallel state
re-initialised in the same processes, the same HF weights loaded):

  1. R2 record: the old log-probs forward-only, recording every token's top-k per MoE layer;
  2. a routing flip: every router's OWN top-k is taken from its scores plus a fixed per-expert
     bias (FLIP), which changes the choice of tokens whose k-th and (k+1)-th scores are closer
     than the bias, without changing any score (the gathered weights stay the same);
  3. the first update (TrainEngine.train_batch with the GRPO loss) replaying the recording:
     reports sum |ratio - 1| over response tokens, the clip fractions and moe/replay_mismatch.

With "control", the same update runs again on a fresh engine WITHOUT replay (routing mode
None, the flip active): the ratio must move off 1. At the end (no spec flag needed), R3 from
the HF backend: rank 0 generates with transformers (routed experts on), the batch goes to every
rank, and the trainer (last spec's layout) replays it in a forward-only pass; also with a
corrupted copy whose mismatch fraction is known exactly.

Rank 0 prints "RESULT {json}" per spec, "CONTROL {json}" and "R3 {json}".
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.multirank.rl_invariance import synthetic_rollout  # noqa: E402

T = 0.8
EPS_LOW, EPS_HIGH = 0.2, 0.28


def parse_spec(spec: str):
    parts = spec.split(",")
    tp, pp, cp, ep = (int(x) for x in parts[:4])
    flags = parts[4].split("+") if len(parts) > 4 and parts[4] else []
    train = SimpleNamespace(micro_batch_size=2,
                            max_tokens_per_micro_batch=48 if "budget" in flags else None,
                            balance_dp=True, packing="packing" in flags)
    return dict(tp=tp, pp=pp, cp=cp, ep=ep), train, flags


def build(model_dir, hf_config, layout_kw, train, sp):
    import torch
    import torch.distributed as dist

    from engine.config.moe_settings import MoEConfig, moe_overrides
    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(dist.get_world_size(), **layout_kw))
    optim = SimpleNamespace(lr=1e-2, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-4, schedule="constant",
                            distributed_optimizer=True)
    overrides = moe_overrides(SimpleNamespace(moe=MoEConfig()), hf_config)
    engine = TrainEngine.build(hf_config, optim, torch.float32, 2, train, weights_dir=model_dir,
                               sequence_parallel=sp, **overrides)
    engine.enable_routing_replay()
    return engine


def flip_routing(engine, bias: float = 0.05) -> None:
    """Every router's own top-k from scores + a fixed per-expert bias; scores unchanged."""
    import torch

    for slot in engine.routing.slots:
        original = slot.get_replay_topk.__func__

        def patched(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None,
                    _slot=slot, _orig=original):
            shift = bias * (torch.arange(scores.shape[1], device=scores.device) % 3)

            def flipped(s, k, num_groups=None, group_topk=None):
                idx = torch.topk(s + shift.to(s.dtype), k=k, dim=1).indices
                return s.gather(1, idx), idx

            return _orig(_slot, scores, topk, num_groups, group_topk, flipped)

        slot.get_replay_topk = patched


def update_with_ratio(engine, seqs):
    """One train_batch with the PPO-clip loss (token-mean); the report has test/ratio_abs_dev
    (sum over response tokens of |ratio - 1|) and test/clip_low / test/clip_high (response
    tokens with ratio below 1 - EPS_LOW / above 1 + EPS_HIGH)."""
    import torch

    from engine.training.loss import GlobalLossNormalizer, aggregate
    from engine.training.token_losses import token_logprobs

    def loss_fn(output, mb):
        logp = token_logprobs(output, mb.labels, engine.vocab_size, T)
        ratio = torch.exp(logp - mb.extras["old_logprobs"])
        adv = mb.extras["advantages"]
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        loss = aggregate(per_token, mb.token_weights)
        with torch.no_grad():
            mask = mb.loss_mask
            report = {"test/loss": loss.detach(),
                      "test/ratio_abs_dev": ((ratio - 1).abs() * mask).sum(),
                      "test/clip_low": ((ratio < 1 - EPS_LOW).float() * mask).sum(),
                      "test/clip_high": ((ratio > 1 + EPS_HIGH).float() * mask).sum(),
                      "test/response_tokens": mask.sum()}
        return loss, report

    keys = ("test/loss", "test/ratio_abs_dev", "test/clip_low", "test/clip_high",
            "test/response_tokens")
    return engine.train_batch(seqs, GlobalLossNormalizer("token-mean"), loss_fn, keys)


def recorded_sequences(engine, batch):
    """Sequences with old log-probs and the R2 recording; returns (seqs, routing table)."""
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs
    from engine.rl.policy.routing_replay import after_old_logprobs, start_routing_replay

    seqs = build_sequences(batch)
    start_routing_replay(engine, "R2")
    table = compute_token_logprobs(engine, seqs, T)
    attach_extra(seqs, "old_logprobs", table)
    after_old_logprobs(engine, seqs, "R2")
    return seqs, table


def run_spec(model_dir, hf_config, spec, batch):
    import torch

    layout_kw, train, flags = parse_spec(spec)
    engine = build(model_dir, hf_config, layout_kw, train, "sp" in flags)
    seqs, _ = recorded_sequences(engine, batch)
    routed = torch.cat([s.extras["routed_experts"].to(torch.int64).flatten() for s in seqs])
    flip_routing(engine)
    out = update_with_ratio(engine, seqs)
    result = {"spec": spec, "ratio_abs_dev": out["test/ratio_abs_dev"],
              "clipfrac_low": out["test/clip_low"],
              "clipfrac_high": out["test/clip_high"],
              "replay_mismatch": out["moe/replay_mismatch"],
              "response_tokens": out["test/response_tokens"],
              "routing_checksum": int((routed * torch.arange(1, routed.numel() + 1)).sum()),
              "routing_values": int(routed.numel())}
    control = None
    if "control" in flags:  # a fresh engine: the same first update without replay
        engine = build(model_dir, hf_config, layout_kw, train, "sp" in flags)
        seqs, _ = recorded_sequences(engine, batch)
        engine.routing.set_mode(None)
        flip_routing(engine)
        out = update_with_ratio(engine, seqs)
        control = {"spec": spec, "ratio_abs_dev": out["test/ratio_abs_dev"],
                   "clipfrac_low": out["test/clip_low"],
                   "clipfrac_high": out["test/clip_high"],
                   "response_tokens": out["test/response_tokens"]}
    return result, control, engine


def r3_from_hf(model_dir, hf_config, spec, batch):
    """R3: routed experts from the HF backend replayed (forward-only) by a fresh engine at
    `spec`'s layout."""
    import torch
    import torch.distributed as dist

    from engine.rl.collect.batch import RolloutBatch, build_sequences
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.generation import SamplingParams
    from engine.generation.hf.backend import HFRolloutEngine

    layout_kw, train, flags = parse_spec(spec)
    engine = build(model_dir, hf_config, layout_kw, train, "sp" in flags)
    box = [None]
    if dist.get_rank() == 0:
        hf = HFRolloutEngine(model_dir)
        hf.enable_routed_experts()
        prompts = batch.prompt_ids[::4]
        gens = hf.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0,
                                                   seeds=list(range(len(prompts)))))
        box = [RolloutBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens],
                            [g.response_logprobs for g in gens], [1.0] * len(gens),
                            routed_experts=[g.routed_experts for g in gens])]
    dist.broadcast_object_list(box, src=0)
    r3 = box[0]
    seqs = build_sequences(r3)
    shapes_ok = all(tuple(s.extras["routed_experts"].shape) == (len(s.tokens), engine.routing.width)
                    for s in seqs)
    own = engine.routing
    own.set_mode("record")  # the trainer's own routing of the same tokens
    plain = compute_token_logprobs(engine, seqs, T)
    recorded = own.recorded()
    own.set_mode("replay")
    replayed = compute_token_logprobs(engine, seqs, T)
    mismatch = own.mismatch()
    agree = differ = 0
    k = own.topk
    for i, s in enumerate(seqs):
        a = s.extras["routed_experts"].to(torch.int64).reshape(len(s.tokens), -1, k).sort(-1).values
        b = recorded[i, :len(s.tokens)].reshape(len(s.tokens), -1, k).sort(-1).values
        same = (a == b).all(-1)
        agree, differ = agree + int(same.sum()), differ + int((~same).sum())
    # corrupt layer 1's choice on every 3rd token of every sequence: a known mismatch
    corrupted = 0
    for s in seqs:
        table = s.extras["routed_experts"].clone().to(torch.int64)
        rows = torch.arange(0, len(s.tokens), 3)
        first = table[rows, :k]
        table[rows, :k] = torch.stack([(first[:, 0] + 1) % own.num_experts,
                                       (first[:, 0] + 2) % own.num_experts], 1)[:, :k]
        corrupted += len(rows)
        s.extras["routed_experts"] = table
    broken = compute_token_logprobs(engine, seqs, T)
    broken_mismatch = own.mismatch()
    own.set_mode(None)
    tokens = sum(len(s.tokens) for s in seqs)
    return {"shapes_ok": shapes_ok, "agree_pairs": agree, "differ_pairs": differ,
            "replay_vs_own_logprob_max": float((replayed - plain).abs().max()),
            "replay_mismatch": mismatch, "corrupted_tokens": corrupted, "tokens": tokens,
            "layers": own.num_layers, "corrupted_mismatch": broken_mismatch,
            "corrupted_logprob_changed": float((broken - replayed).abs().max())}


def main():
    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    model_dir, specs = sys.argv[1], sys.argv[2:]
    rank, _ = init_distributed()
    hf_config = read_config(model_dir)
    batch = synthetic_rollout(hf_config["vocab_size"])
    for spec in specs:
        result, control, _ = run_spec(model_dir, hf_config, spec, batch)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
            if control is not None:
                print("CONTROL " + json.dumps(control), flush=True)
    out = r3_from_hf(model_dir, hf_config, specs[-1], batch)
    if rank == 0:
        print("R3 " + json.dumps(out), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
