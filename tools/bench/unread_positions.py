"""train.skip_unread_positions on vs off (models.layers.unread_positions): the last layer's MLP
only at the trained positions, against the full layer, in one process on the same batches.

Model: tools.bench.trl_workload's (Qwen3-shaped, fp32, hidden 384, 4 layers, FFN 1,152,
vocabulary 128; `--quick`: its smaller one), random weights, TP1 on this host's threads.
Rows, random ids with the shapes of tools.bench.trl's workloads (prompt tokens untrained,
reply tokens trained):
  grpo_shared:   16 rows of a 350-token prompt and a 32-token reply;
  grpo_distinct: 16 rows of a 125-token prompt and a 32-token reply;
  sft:           8 rows of a 140-token prompt and a 110-token completion;
  dpo:           8 pairs of a 140-token prompt and two 70-token replies (16 rows);
  grpo_tree:     grpo_shared's sizes as its workload has them (a 300-token system prompt and
                 2 questions, 8 replies each), run with train.prefix_sharing=true (packed; the
                 engine's default there: each prompt runs once, the skip leaves the tree's
                 prompt nodes out).
Each pass is one TrainEngine.train_batch (token-mean cross-entropy on the trained tokens:
forward, backward, AdamW step) of one engine whose `batching.skip_unread_positions` is
flipped between passes; the two modes alternate (which goes first alternates by round), so a
change of the host's load meets both alike. Round 0 is a warm-up, untimed, and its losses
and grad norms are the compared numbers (the same weights in both modes: the optimizer
steps of the warm-up are undone by restoring the weights before each pass).

Reported per workload: seconds per pass, skip on and off (medians, quartiles), the speed-up
(off / on, median of the per-round ratios, with their quartiles), the share of rows the MLP
skipped, and |loss on - loss off| / loss, |grad norm on - off| / grad norm.

    python -m tools.bench unread_positions [--quick] [--repeats N]
"""
from __future__ import annotations

import os
import tempfile
import time

from tools.bench.common import BenchResult, Table, constant_adam, fmt, spread

SHAPES = {"grpo_shared": (16, 350, [32]), "grpo_distinct": (16, 125, [32]),
          "sft": (8, 140, [110]), "dpo": (8, 140, [70, 70]),
          "grpo_tree": (16, 350, [32])}   # rows, prompt, reply lengths
TREE = "grpo_tree"   # with train.prefix_sharing: a shared system prompt, 2 groups of 8
REPEATS = 6
QUICK_REPEATS = 2


def _sequences(name: str, vocab: int, scale: float):
    """The workload's SequenceData (module docstring), lengths times `scale`."""
    import random

    from engine.training.micro_batches import SequenceData

    rng = random.Random(name)
    rows, prompt, replies = SHAPES[name]
    prompt = max(2, int(prompt * scale))
    system = [rng.randrange(4, vocab) for _ in range(prompt * 6 // 7)]
    questions = [system + [rng.randrange(4, vocab) for _ in range(prompt - len(system))]
                 for _ in range(2)]
    seqs = []
    for row in range(rows):
        ids = (questions[row * 2 // rows] if name == TREE
               else [rng.randrange(4, vocab) for _ in range(prompt)])
        for reply in replies:
            reply = max(2, int(reply * scale))
            full = ids + [rng.randrange(4, vocab) for _ in range(reply + 1)]
            seqs.append(SequenceData(full[:-1], full[1:], [0] * (prompt - 1) + [1] * (reply + 1)))
    return seqs


def _tree_nodes(seqs) -> int:
    """Tokens a prefix tree of `seqs` runs: its distinct prefixes (a trie's nodes)."""
    root, nodes = {}, 0
    for s in seqs:
        node = root
        for t in s.tokens:
            if t not in node:
                node[t] = {}
                nodes += 1
            node = node[t]
    return nodes


def _engine(model_dir: str):
    import torch

    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config

    optim = constant_adam(1e-5, distributed=False)
    return TrainEngine.build(read_config(model_dir), optim, torch.float32, 10 ** 6,
                             BatchSettings(micro_batch_size=1, max_tokens_per_micro_batch=8192),
                             weights_dir=model_dir)


def _loss_fn(vocab: int):
    from engine.training.loss import aggregate
    from engine.training.token_losses import token_logprobs

    def fn(out, mb):
        loss = aggregate(-token_logprobs(out, mb.labels, vocab, 1.0), mb.token_weights)
        return loss, {"loss": loss}

    return fn


def _pass(engine, seqs, skip: bool, weights) -> tuple[float, dict]:
    """One train_batch with the skip `skip`, from the weights `weights` (restored first)."""
    import torch

    from engine.training.loss import GlobalLossNormalizer

    with torch.no_grad():
        for p, w in zip(engine.chunks[0].parameters(), weights):
            p.copy_(w)
    engine.batching.skip_unread_positions = skip
    start = time.perf_counter()
    out = engine.train_batch(seqs, GlobalLossNormalizer("token-mean"),
                             _loss_fn(engine.vocab_size), ["loss"])
    return time.perf_counter() - start, out


def run_unread_positions(quick: bool, repeats: int | None = None) -> BenchResult:
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel
    from tools.bench.trl_workload import MODEL, QUICK_MODEL, VOCAB
    from tools.tiny_models import build_tiny_model

    init_distributed()   # a 1-process group of its own unless launched (a free port)
    setup_model_parallel(ParallelLayout(1))
    repeats = repeats or (QUICK_REPEATS if quick else REPEATS)
    shape = dict(QUICK_MODEL if quick else MODEL, vocab_size=VOCAB)
    rows, summary = [], {"unread_quick": quick}
    with tempfile.TemporaryDirectory(prefix="bench_unread_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **shape)
        engine = _engine(model_dir)
        weights = [p.detach().clone() for p in engine.chunks[0].parameters()]
        try:
            for name in SHAPES:
                seqs = _sequences(name, VOCAB, 0.25 if quick else 1.0)
                engine.batching.prefix_sharing = engine.batching.packing = name == TREE
                times = {True: [], False: []}
                first = {}
                for k in range(repeats + 1):
                    for skip in ((True, False) if k % 2 == 0 else (False, True)):
                        seconds, out = _pass(engine, seqs, skip, weights)
                        if k == 0:
                            first[skip] = out
                        else:
                            times[skip].append(seconds)
                ratios = [off / on for on, off in zip(times[True], times[False])]
                tokens = (_tree_nodes(seqs) if name == TREE
                          else sum(len(s.tokens) for s in seqs))
                trained = sum(sum(s.loss_mask) for s in seqs)
                loss_rel = (abs(first[True]["loss"] - first[False]["loss"])
                            / abs(first[False]["loss"]))
                gn_rel = (abs(first[True]["grad_norm"] - first[False]["grad_norm"])
                          / first[False]["grad_norm"])
                on, off, r = spread(times[True]), spread(times[False]), spread(ratios)
                rows.append([name, str(len(seqs)), f"{1 - trained / tokens:.0%}",
                             f"{fmt(off['median'])} ({fmt(off['q1'])}-{fmt(off['q3'])})",
                             f"{fmt(on['median'])} ({fmt(on['q1'])}-{fmt(on['q3'])})",
                             f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})",
                             f"{loss_rel:.1e}", f"{gn_rel:.1e}"])
                summary[f"unread_{name}"] = {"speedup": r["median"],
                                             "speedup_quartiles": [r["q1"], r["q3"]],
                                             "on_s": on["median"], "off_s": off["median"],
                                             "skipped_share": 1 - trained / tokens,
                                             "loss_rel": loss_rel, "grad_norm_rel": gn_rel}
        finally:
            engine.release()
    table = Table(
        f"The last layer only where a loss reads: train.skip_unread_positions off vs on "
        f"(one process, hidden {shape['hidden']}, {shape['layers']} layers, {repeats} rounds)",
        ["workload", "rows", "rows skipped", "off s (quartiles)", "on s (quartiles)",
         "speed-up off/on (quartiles)", "loss rel", "grad norm rel"], rows,
        notes=["one train_batch per pass (forward, backward, AdamW), the same weights in both "
               "modes; rows skipped: the share of the last layer's MLP rows not run"])
    return BenchResult([table], summary)


def main(argv: list[str], prog: str = "python -m tools.bench unread_positions") -> int:
    import argparse

    from tools.bench.common import emit, quiet_libraries

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smaller model, 2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    quiet_libraries()
    emit(run_unread_positions(args.quick, args.repeats))
    return 0
