"""Weight gradients accumulated in fp32 (models.build.wgrad_fp32, engine.training.loss_head),
launched by tests/test_fp32_wgrad.py on 2 ranks:

    torchrun --nproc_per_node 2 tests/multirank/fp32_wgrad_check.py QWEN3_DIR

kind "linear": megatron's ColumnParallelLinear and RowParallelLinear under megatron DDP (fp32
main_grad), at TP1, TP2 and TP2 + sequence parallelism; MICRO micro-batches of bf16 inputs and
upstream gradients. Compared with the exact sum over micro-batches of grad_output^T @ input
(float64 of the same bf16 values): main_grad with the fusion ("fused") and with megatron's
unfused path ("unfused": a bf16 weight gradient per micro-batch added by DDP's hook, the
negative control). The same in fp32: fused and unfused main_grad bitwise equal.

kind "head": the chunked loss head with a bf16 output weight carrying DDP's fp32 main_grad,
MICRO micro-batches of TOKENS tokens, vocab-parallel at TP1/TP2, entropy and temperature 0.9.
Reference: the same head on the same values upcast to fp32. "chunk_rel": main_grad with 8-token
chunks against one chunk per micro-batch (a per-chunk rounding would show here); the negative
control "per_chunk_bf16" rounds each chunk's weight gradient to bf16 (the head before
models.build.wgrad_fp32); "no_main_grad": the weight without main_grad (its bf16 gradient per
micro-batch, what DDP's hook adds). "*_exact_rel": against the exact (float64) sum of the
products the head's weight-gradient GEMMs were given (the bf16 rounding of grad_z itself, as a
bf16 GEMM input, is common to every path and not the accumulation's).

kind "model": the tiny Qwen3 (tied embeddings) through TrainEngine at TP2 + SP and PP2: main_grad
of one batch (several micro-batches, chunked head) with the fusion on and off. fp32: bitwise;
bf16: close (the unfused path rounds per micro-batch); "broken": the tied embedding without
megatron's `zero_out_wgrad` mark, so the head hands DDP a dummy for it too and DDP's hook drops
the embedding lookup's gradient, which must differ.
Rank 0 prints one "RESULT {json}" line per case.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from parallel.layout import ParallelLayout  # noqa: E402
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown  # noqa

MICRO, SEQ, BATCH, IN, OUT = 4, 8, 2, 64, 48
TOKENS, HIDDEN, PADDED, VOCAB = 96, 32, 128, 100


def local_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (float((a.double() - b.double()).abs().max())
            / max(float(b.double().abs().max()), 1e-30))


def world_max(value: float) -> float:
    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def emit(**fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(fields), flush=True)


# ---- megatron linears -------------------------------------------------------------------

def _linears(dtype: torch.dtype, sp: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, sequence_parallel=sp,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               use_cpu_initialization=True, perform_initialization=False)
    module = torch.nn.Module()
    module.config = config
    module.col = ColumnParallelLinear(IN, OUT, config=config, init_method=None, bias=False,
                                      gather_output=False)
    module.row = RowParallelLinear(OUT, IN, config=config, init_method=None, bias=False,
                                   input_is_parallel=True, skip_bias_add=True)
    gen = torch.Generator().manual_seed(5)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        col_w = torch.randn(OUT, IN, generator=gen) * 0.1
        row_w = torch.randn(IN, OUT, generator=gen) * 0.1
        module.col.weight.copy_(col_w.chunk(tp, 0)[rank])
        module.row.weight.copy_(row_w.chunk(tp, 1)[rank])
    return module


def _ddp(module, fused: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from models.build import wgrad_fp32

    if fused:
        wgrad_fp32.enable([module])
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    return DistributedDataParallel(module.config, cfg, module=module)


def _linear_inputs(dtype):
    """Per micro-batch: full bf16 inputs [s, b, IN] / [s, b, OUT] and upstream gradients, the
    same on every rank (positive means: sums that grow, as real gradients' do)."""
    gen = torch.Generator().manual_seed(9)
    out = []
    for _ in range(MICRO):
        x = (torch.randn(SEQ, BATCH, IN, generator=gen) + 0.5).to(dtype)
        g_col = (torch.randn(SEQ, BATCH, OUT, generator=gen) + 0.5).to(dtype)
        x_row = (torch.randn(SEQ, BATCH, OUT, generator=gen) + 0.5).to(dtype)
        g_row = (torch.randn(SEQ, BATCH, IN, generator=gen) + 0.5).to(dtype)
        out.append((x, g_col, x_row, g_row))
    return out


def _linear_main_grads(dtype, sp: bool, fused: bool):
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    module = _linears(dtype, sp)
    ddp = _ddp(module, fused)
    ddp.zero_grad_buffer()
    seq = (lambda t: t.chunk(tp, 0)[rank]) if sp else (lambda t: t)
    for x, g_col, x_row, g_row in _linear_inputs(dtype):
        y, _ = module.col(seq(x).clone().requires_grad_())
        y.backward(g_col.chunk(tp, 2)[rank])                  # column output: sharded on OUT
        z, _ = module.row(x_row.chunk(tp, 2)[rank].clone().requires_grad_())
        z.backward(seq(g_row))                                 # row output: SP-scattered on seq
    return module.col.weight.main_grad.clone(), module.row.weight.main_grad.clone()


def _linear_reference():
    """float64 sums over micro-batches of grad_output^T @ input, this rank's shards."""
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    col = torch.zeros(OUT, IN, dtype=torch.float64)
    row = torch.zeros(IN, OUT, dtype=torch.float64)
    for x, g_col, x_row, g_row in _linear_inputs(torch.bfloat16):
        col += g_col.double().reshape(-1, OUT).t() @ x.double().reshape(-1, IN)
        row += g_row.double().reshape(-1, IN).t() @ x_row.double().reshape(-1, OUT)
    return col.chunk(tp, 0)[rank], row.chunk(tp, 1)[rank]


def run_linears() -> None:
    for tp, sp in ((1, False), (2, False), (2, True)):
        setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, sequence_parallel=sp))
        ref = _linear_reference()
        fused = _linear_main_grads(torch.bfloat16, sp, True)
        unfused = _linear_main_grads(torch.bfloat16, sp, False)
        f32 = [_linear_main_grads(torch.float32, sp, flag) for flag in (True, False)]
        for i, name in enumerate(("column", "row")):
            emit(kind="linear", tp=tp, sp=sp, linear=name,
                 main_grad_dtype=str(fused[i].dtype),
                 fused_rel=world_max(local_rel(fused[i], ref[i])),
                 unfused_rel=world_max(local_rel(unfused[i], ref[i])),
                 fp32_bitwise=bool(world_max(float(not torch.equal(f32[0][i], f32[1][i]))) == 0),
                 fp32_nonzero=bool(f32[0][i].abs().max() > 0))


# ---- the loss head ----------------------------------------------------------------------

def _head_inputs():
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(PADDED, HIDDEN, generator=gen) * 0.3
    batches = []
    for _ in range(MICRO):
        h = torch.randn(TOKENS, HIDDEN, generator=gen) + 0.3
        labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
        g_logp = -torch.rand(TOKENS, generator=gen)        # -token weights, as a loss gives
        g_ent = -0.1 * torch.rand(TOKENS, generator=gen)
        batches.append((h, labels, g_logp, g_ent))
    return w, batches


def _per_chunk_bf16(c, a, b):
    """The head before this change: each chunk's weight gradient a bf16 GEMM output."""
    c.add_(torch.mm(a, b).float())


def _head_grad(dtype, chunk: int, main_grad: bool, accumulate=None):
    """(this TP rank's output-weight gradient over MICRO micro-batches, the exact float64 sum
    of the products the head's weight-gradient GEMMs were given). The gradient: main_grad
    (DDP's protocol) or the sum of the weight's per-micro-batch gradients (what DDP's hook
    adds). `accumulate`: the head's per-chunk accumulation instead of its own."""
    import engine.training.loss_head as head

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full_w, batches = _head_inputs()
    w = full_w.to(torch.bfloat16).to(dtype).chunk(tp, 0)[rank].clone().requires_grad_()
    total = torch.zeros(w.shape, dtype=torch.float32)
    exact = torch.zeros(w.shape, dtype=torch.float64)
    if main_grad:
        w.main_grad, w.grad_added_to_main_grad = total, False
    original = head.accumulate_matmul_fp32_
    inner = accumulate or original

    def recording(c, a, b):
        exact.add_(a.double() @ b.double())
        inner(c, a, b)

    head.accumulate_matmul_fp32_ = recording
    try:
        for h, labels, g_logp, g_ent in batches:
            x = h.to(torch.bfloat16).to(dtype)
            logp, ent = head.chunked_logprobs(x, w, labels, VOCAB, 0.9, chunk, True)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            if not main_grad:
                total.add_(w.grad.float())
            w.grad = None
    finally:
        head.accumulate_matmul_fp32_ = original
    return total.double(), exact


def run_heads() -> None:
    for tp in (1, 2):
        setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp))
        ref, _ = _head_grad(torch.float32, TOKENS, False)
        fused, fused_exact = _head_grad(torch.bfloat16, 8, True)
        one_chunk, _ = _head_grad(torch.bfloat16, TOKENS, True)
        no_main, no_main_exact = _head_grad(torch.bfloat16, 8, False)
        per_chunk, per_chunk_exact = _head_grad(torch.bfloat16, 8, True, _per_chunk_bf16)
        per_chunk_one, _ = _head_grad(torch.bfloat16, TOKENS, True, _per_chunk_bf16)
        emit(kind="head", tp=tp,
             fused_exact_rel=world_max(local_rel(fused, fused_exact)),
             fused_rel=world_max(local_rel(fused, ref)),
             chunk_rel=world_max(local_rel(fused, one_chunk)),
             no_main_grad_exact_rel=world_max(local_rel(no_main, no_main_exact)),
             no_main_grad_rel=world_max(local_rel(no_main, ref)),
             per_chunk_bf16_exact_rel=world_max(local_rel(per_chunk, per_chunk_exact)),
             per_chunk_bf16_rel=world_max(local_rel(per_chunk, ref)),
             per_chunk_bf16_chunk_rel=world_max(local_rel(per_chunk, per_chunk_one)))


# ---- the model through TrainEngine ------------------------------------------------------

def _sequences(vocab: int):
    import random

    from engine.training.micro_batches import SequenceData

    rng = random.Random(4)
    seqs = []
    for _ in range(8):
        n = rng.randint(10, 20)
        ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
        seqs.append(SequenceData(ids[:-1], ids[1:], [0] * 3 + [1] * (n - 3)))
    return seqs


def _model_grads(model_dir: str, layout: dict, sp: bool, dtype, fused: bool,
                 drop_zero_out: bool = False):
    from engine.training.loss import GlobalLossNormalizer, aggregate
    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import run_micro_batches
    from engine.training.token_losses import token_logprobs_and_entropy
    from engine.training.train_engine import TrainEngine
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from models.hf.io import read_config

    hf_config = read_config(model_dir)
    setup_model_parallel(ParallelLayout(dist.get_world_size(), sequence_parallel=sp, **layout))
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=False)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    state = TrainEngine.build(hf_config, optim, dtype, 1, train, weights_dir=model_dir,
                              sequence_parallel=sp, loss_chunk_tokens=7)
    linears = [m for c in state.chunks for m in c.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.gradient_accumulation_fusion for m in linears)
    for m in linears:
        m.gradient_accumulation_fusion = fused
    for p in (p for c in state.chunks for p in c.parameters()):
        if drop_zero_out and getattr(p, "zero_out_wgrad", False):
            p.zero_out_wgrad = False  # the head then hands DDP a dummy for the tied weight
    vocab = hf_config["vocab_size"]

    def loss_fn(out, mb):
        logp, ent = token_logprobs_and_entropy(out, mb.labels, vocab, 0.9, True)
        loss = aggregate(-logp - 0.1 * ent, mb.token_weights)
        return loss, {"loss": loss}

    norm = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    batch = build_rank_batch(_sequences(vocab), norm, state.batching, sequence_parallel=sp)
    for c in state.chunks:
        c.zero_grad_buffer()
    run_micro_batches(state.chunks, batch.micro_batches, loss_fn, loss_chunk_tokens=7)
    return {f"{i}.{n}": p.main_grad.clone() for i, c in enumerate(state.chunks)
            for n, p in c.named_parameters()}, len(batch.micro_batches), len(linears)


def run_models(model_dir: str) -> None:
    for name, layout, sp in (("tp2_sp", dict(tp=2), True), ("pp2", dict(pp=2), False)):
        for dtype in (torch.float32, torch.bfloat16):
            on, micro, linears = _model_grads(model_dir, layout, sp, dtype, True)
            off, _, _ = _model_grads(model_dir, layout, sp, dtype, False)
            rels = {k: local_rel(on[k], off[k]) for k in off}
            worst = max(rels, key=rels.get)
            bitwise = all(torch.equal(on[k], off[k]) for k in off)
            emit(kind="model", layout=name, dtype=str(dtype), micro_batches=micro,
                 linears=linears, rel=world_max(rels[worst]), worst_rank0=worst,
                 bitwise=bool(world_max(float(not bitwise)) == 0),
                 main_grad_dtype=str(next(iter(on.values())).dtype))
        if name == "tp2_sp":  # tied embeddings at pp=1: the lookup's gradient must count
            broken, _, _ = _model_grads(model_dir, layout, sp, torch.bfloat16, True,
                                        drop_zero_out=True)
            rels = {k: local_rel(broken[k], off[k]) for k in off}
            worst = max(rels, key=rels.get)
            emit(kind="model", layout=name, dtype="torch.bfloat16", broken=True,
                 rel=world_max(rels[worst]), worst_rank0=worst)


def main() -> None:
    init_distributed()
    run_linears()
    run_heads()
    run_models(sys.argv[1])
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
