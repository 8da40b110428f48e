"""train.skip_unread_positions (models.layers.unread_positions) gives the full layer's numbers.

Run under torchrun (2 ranks; tests/test_unread_positions.py). Every layout of MODEL_LAYOUTS
builds the tiny model with TrainEngine and runs, once with the last layer skipping the MLP at
unread positions and once without, on the same sequences (prompt-then-reply loss masks, and
one row whose trained tokens sit in its middle, as a multi-turn row's): the loss and entropy
reports of one forward and backward, every parameter's gradient, and the forward-only
log-prob table (engine.rl.policy.logprobs: trained positions only); with prefix sharing, on
rows sharing prompts (at CP2 a tree runs the full layer). Per case: how many rows the
last layer's MLP saw in each mode (a hook on its `mlp`), and the negative control: the
log-prob an *unread* position gets in each mode (the table hides it; a loss that read it
would see this difference). Under Megatron SP the model runs the full layer (the module's
`unsupported` says why): the rows seen are equal there. Rank 0 prints one "RESULT {json}" line
per case.
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from parallel.layout import ParallelLayout  # noqa: E402
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown  # noqa

MODEL_LAYOUTS = [  # (name, layout, sp, packing; "tree": prefix sharing on shared prompts)
    ("dp2", dict(), False, False), ("tp2", dict(tp=2), False, False),
    ("tp2_sp", dict(tp=2), True, False), ("pp2", dict(pp=2), False, False),
    ("cp2_packed", dict(cp=2), False, True), ("dp2_packed", dict(), False, True),
    ("dp2_tree", dict(), False, "tree"), ("cp2_tree", dict(cp=2), False, "tree")]


def emit(**fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(fields), flush=True)


def world_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sequences(vocab: int, shared: bool = False):
    """8 prompt-then-reply rows and one row trained in its middle; `shared`: 4 prompts with 3
    replies each (rows a prefix tree shares) instead."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(5)
    seqs = []
    if shared:
        for _ in range(4):
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(10, 16))]
            for _ in range(3):
                ids = prompt + [rng.randrange(4, vocab) for _ in range(rng.randint(3, 8))]
                seqs.append(SequenceData(ids[:-1], ids[1:], [0] * (len(prompt) - 1)
                                         + [1] * (len(ids) - len(prompt))))
        return seqs
    for _ in range(8):
        n = rng.randint(12, 28)
        ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
        start = rng.randint(n // 2, n - 2)
        seqs.append(SequenceData(ids[:-1], ids[1:], [0] * start + [1] * (n - start)))
    ids = [rng.randrange(4, vocab) for _ in range(25)]
    seqs.append(SequenceData(ids[:-1], ids[1:], [0] * 6 + [1] * 8 + [0] * 10))
    return seqs


def loss_fn(vocab: int):
    from engine.training.loss import aggregate
    from engine.training.token_losses import token_logprobs_and_entropy

    def fn(out, mb):
        logp, ent = token_logprobs_and_entropy(out, mb.labels, vocab, 0.9, True)
        loss = aggregate(-logp - 0.1 * ent, mb.token_weights)
        return loss, {"loss": loss, "entropy": aggregate(ent, mb.token_weights)}

    return fn


def unread_logprob_fn(vocab: int, out: list):
    """An output_fn that keeps the log-prob of each micro-batch's first unread, non-padding
    position (the negative control)."""
    from engine.training.token_losses import token_logprobs

    def fn(output, mb):
        logp = token_logprobs(output, mb.labels, vocab, 1.0)
        unread = ((mb.loss_mask == 0) & (mb.seq_ids >= 0)).nonzero()
        if len(unread):
            out.append(float(logp[tuple(unread[-1])]))

    return fn


def run(state, seqs, skip: bool) -> dict:
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import reduce_reports, run_micro_batches
    from parallel.wrappers import unwrap

    state.batching.skip_unread_positions = skip
    rows = []
    layer = unwrap(state.chunks[-1]).decoder.layers[-1] if ps.is_pipeline_last_stage() else None
    hook = (layer.mlp.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]
                                                                          * a[0].shape[1]))
            if layer is not None else None)
    norm = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    batch = build_rank_batch(seqs, norm, state.batching,
                             sequence_parallel=state.sequence_parallel)
    for c in state.chunks:
        c.zero_grad_buffer()
    reports = run_micro_batches(state.chunks, batch.micro_batches, loss_fn(state.vocab_size),
                                loss_chunk_tokens=state.loss_chunk_tokens, skip_unread=skip)
    out = reduce_reports(reports, ["loss", "entropy"])
    grads = {n: p.main_grad.clone() for c in state.chunks for n, p in c.named_parameters()}
    table = compute_token_logprobs(state, seqs, 0.9)
    unread = []
    state.forward_only(seqs, output_fn=unread_logprob_fn(state.vocab_size, unread))
    if hook is not None:
        hook.remove()
    return {"out": out, "grads": grads, "table": table, "rows": sum(rows[:len(
        batch.micro_batches)]), "unread": unread}


def case(model_dir: str, layout: dict, sp: bool, packing: bool) -> dict:
    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config
    from models.layers.unread_positions import unsupported

    hf_config = read_config(model_dir)
    setup_model_parallel(ParallelLayout(dist.get_world_size(), sequence_parallel=sp, **layout))
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    tree = packing == "tree"
    batching = (BatchSettings(micro_batch_size=1, max_tokens_per_micro_batch=4096,
                              packing=True, prefix_sharing=True) if tree
                else BatchSettings(micro_batch_size=3, packing=packing))
    state = TrainEngine.build(hf_config, optim, torch.float32, 1, batching,
                              weights_dir=model_dir, sequence_parallel=sp)
    seqs = sequences(hf_config["vocab_size"], shared=tree)
    full, skip = run(state, seqs, False), run(state, seqs, True)
    grad_rel = max(float((skip["grads"][k] - g).norm() / g.norm().clamp_min(1e-30))
                   for k, g in full["grads"].items())
    unread_gap = max([abs(a - b) for a, b in zip(full["unread"], skip["unread"])] or [0.0])
    reason = unsupported(state.chunks)
    state.release()
    return {"loss": full["out"]["loss"],
            "loss_rel": abs(skip["out"]["loss"] - full["out"]["loss"]) / abs(full["out"]["loss"]),
            "entropy_rel": abs(skip["out"]["entropy"] - full["out"]["entropy"])
            / abs(full["out"]["entropy"]),
            "grad_rel": world_max(grad_rel),
            "table_rel": float((skip["table"] - full["table"]).abs().max()
                               / full["table"].abs().max()),
            "table_zero_unread": bool((full["table"][0, :1] == 0).all()),
            "rows_full": world_max(full["rows"]), "rows_skip": world_max(skip["rows"]),
            "unread_gap": world_max(unread_gap), "unsupported": reason}


def main() -> None:
    init_distributed()
    for name, layout, sp, packing in MODEL_LAYOUTS:
        emit(layout=name, **case(sys.argv[1], layout, sp, packing))
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
