"""The chunked loss head against today's unchunked path (launched by tests/test_loss_head.py).

    torchrun --nproc_per_node 2 tests/multirank/loss_head_check.py TIED_DIR UNTIED_DIR

Function level (kind "function"): random hidden states, a padded vocabulary (the last TP shard
holds padding rows), random upstream gradients for log p and entropy; at TP1 and TP2, with and
without Megatron SP, temperature 1.0 and 0.8, entropy on and off, chunks of 7 tokens (ragged)
and one chunk; fp32 (and one bf16 case). Reference: megatron's TP input region + full logits
+ engine.training.token_losses. Compared: log p, entropy, d/d hidden (the SP-scattered or
replicated input of the output layer) and d/d weight shard. "broken" cases: the same with
the TP region's backward reduction dropped (the classic bug), which must differ.

Model level (kind "model"): the tiny Qwen3 (tied embeddings) and Qwen2 (untied, vocab 1001:
padding rows) through TrainEngine at DP2, TP2, TP2+SP, PP2, CP2 (packed): one forward and
backward of a loss using log-probs and entropy (temperature 0.9) with `loss_chunk_tokens` None
(megatron's logits) and 5, and the forward-only recomputed log-probs
(engine.rl.policy.logprobs.compute_token_logprobs). Compared: loss, every parameter's gradient
(main_grad: the output weight / tied embedding, and every layer behind the hidden states), the
log-prob table. "broken" model cases: models.layers.heads.output.tp_replicated_input without the TP
reduction of the hidden-state gradient. Rank 0 prints one "RESULT {json}" line per case.
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
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # noqa: E402

import models.layers.heads.output as output_head  # noqa: E402
from engine.training.loss_head import HiddenStates  # noqa: E402
from engine.training.token_losses import token_logprobs_and_entropy  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown  # noqa

PADDED, VOCAB, HIDDEN, SEQ, BATCH = 128, 100, 16, 12, 3


def local_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 on this rank."""
    return (float((a.double() - b.double()).abs().max())
            / max(float(b.double().abs().max()), 1e-30))


def world_max(value: float) -> float:
    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """local_rel maximised over the world (collective)."""
    return world_max(local_rel(a, b))


def no_tp_reduction(layer, hidden):
    """models.layers.heads.output.tp_replicated_input without the backward TP sum (the bug)."""
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    return hidden


def function_case(sp, temperature, entropy, chunk, dtype, broken=False):
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(11)
    full_h = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    full_w = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    g_logp, g_ent = torch.randn(BATCH, SEQ, generator=gen), torch.randn(BATCH, SEQ, generator=gen)
    width, piece = PADDED // tp, SEQ // tp
    layer = SimpleNamespace(sequence_parallel=sp, tp_group=None)
    results = []
    for chunked in (False, True):
        h = (full_h[rank * piece:(rank + 1) * piece] if sp else full_h).to(dtype).clone()
        w = full_w[rank * width:(rank + 1) * width].to(dtype).clone()
        h.requires_grad_(), w.requires_grad_()
        region = no_tp_reduction if (broken and chunked) else output_head.tp_replicated_input
        x = region(layer, h)
        out = (HiddenStates(x.transpose(0, 1), w, chunk) if chunked
               else torch.matmul(x, w.t()).transpose(0, 1))
        logp, ent = token_logprobs_and_entropy(out, labels, VOCAB, temperature, entropy)
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0.0)
        loss.backward()
        results.append((logp.detach(), ent.detach(), h.grad, w.grad))
    (lp0, e0, h0, w0), (lp1, e1, h1, w1) = results
    return {"logp_rel": rel(lp1, lp0), "entropy_rel": rel(e1, e0), "hidden_grad_rel": rel(h1, h0),
            "weight_grad_rel": rel(w1, w0)}


def run_functions(world: int) -> None:
    for tp in (1, 2):
        setup_model_parallel(ParallelLayout(world, tp=tp))
        for sp in ((False, True) if tp > 1 else (False,)):
            cases = [(t, e, c, torch.float32) for t in (1.0, 0.8) for e in (False, True)
                     for c in (7, 1000)] + [(0.8, True, 7, torch.bfloat16)]
            for temperature, entropy, chunk, dtype in cases:
                out = function_case(sp, temperature, entropy, chunk, dtype)
                emit(kind="function", tp=tp, sp=sp, temperature=temperature, entropy=entropy,
                     chunk=chunk, dtype=str(dtype), **out)
            if tp > 1:
                out = function_case(sp, 1.0, True, 7, torch.float32, broken=True)
                emit(kind="function", tp=tp, sp=sp, broken=True, **out)


def emit(**fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(fields), flush=True)


def sequences(vocab: int):
    from engine.training.micro_batches import SequenceData

    rng = random.Random(3)
    seqs = []
    for i in range(8):
        n = rng.randint(8, 24)
        ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
        start = rng.randint(1, n - 2)
        seqs.append(SequenceData(ids[:-1], ids[1:], [0] * start + [1] * (n - start)))
    return seqs


def head_loss_fn(vocab: int):
    from engine.training.loss import aggregate

    def loss_fn(out, mb):
        logp, ent = token_logprobs_and_entropy(out, mb.labels, vocab, 0.9, True)
        loss = aggregate(-logp - 0.1 * ent, mb.token_weights)
        return loss, {"loss": loss}

    return loss_fn


def grads_and_logprobs(state, seqs, chunk):
    """(loss, {param name: main_grad}, log-prob table) with loss_chunk_tokens=`chunk`."""
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import reduce_reports, run_micro_batches

    state.loss_chunk_tokens = chunk
    norm = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    batch = build_rank_batch(seqs, norm, state.batching, sequence_parallel=state.sequence_parallel)
    for c in state.chunks:
        c.zero_grad_buffer()
    reports = run_micro_batches(state.chunks, batch.micro_batches, head_loss_fn(state.vocab_size),
                                loss_chunk_tokens=chunk)
    loss = reduce_reports(reports, ["loss"])["loss"]
    grads = {f"{i}.{n}": p.main_grad.clone() for i, c in enumerate(state.chunks)
             for n, p in c.named_parameters()}
    return loss, grads, compute_token_logprobs(state, seqs, 0.9)


def model_case(model_dir: str, layout: dict, sp: bool, packing: bool, broken: bool = False):
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config

    hf_config = read_config(model_dir)
    setup_model_parallel(ParallelLayout(dist.get_world_size(), sequence_parallel=sp, **layout))
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=packing)
    state = TrainEngine.build(hf_config, optim, torch.float32, 1, train, weights_dir=model_dir,
                              sequence_parallel=sp)
    seqs = sequences(hf_config["vocab_size"])
    loss0, grads0, table0 = grads_and_logprobs(state, seqs, None)
    original = output_head.tp_replicated_input
    if broken:
        output_head.tp_replicated_input = no_tp_reduction
    try:
        loss1, grads1, table1 = grads_and_logprobs(state, seqs, 5)
    finally:
        output_head.tp_replicated_input = original
    per_param = {k: local_rel(grads1[k], grads0[k]) for k in grads0}  # this rank's params
    worst = max(per_param, key=per_param.get)
    return {"loss": loss0, "loss_rel": abs(loss1 - loss0) / abs(loss0),
            "grad_rel": world_max(per_param[worst]), "worst_param_rank0": worst,
            "n_params_rank0": len(grads0), "logprob_rel": rel(table1, table0)}


MODEL_LAYOUTS = [  # (name, layout, sp, packing)
    ("dp2", dict(), False, False), ("tp2", dict(tp=2), False, False),
    ("tp2_sp", dict(tp=2), True, False), ("pp2", dict(pp=2), False, False),
    ("cp2_packed", dict(cp=2), False, True)]


def run_models(tied_dir: str, untied_dir: str) -> None:
    for model, model_dir in (("tied", tied_dir), ("untied", untied_dir)):
        for name, layout, sp, packing in MODEL_LAYOUTS:
            emit(kind="model", model=model, layout=name,
                 **model_case(model_dir, layout, sp, packing))
        for name, layout, sp, packing in MODEL_LAYOUTS[1:3]:
            emit(kind="model", model=model, layout=name, broken=True,
                 **model_case(model_dir, layout, sp, packing, broken=True))


def main() -> None:
    _, world = init_distributed()
    run_functions(world)
    run_models(sys.argv[1], sys.argv[2])
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
