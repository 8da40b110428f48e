"""Megatron sequence parallelism and activation recomputation, single process: the config keys
and their checks (engine.config.model_settings, parallel.layout), the TransformerConfig fields they
map to, the padding they need (engine.training.rank_batch), the SP-capable norm of the local layer spec
(models.layers.norms.local) and the memory estimate's factors (engine.config.recipe_validation). The multi-rank
invariance of the loss and gradient is in tests/test_sft_invariance.py.
"""
from types import SimpleNamespace

import pytest
import torch

from engine.config.schema import SFTConfig, load_config, sft_problems
from engine.training.loss import GlobalLossNormalizer
from engine.training.micro_batches import SequenceData
from engine.config.model_settings import (describe, megatron_overrides, recompute_layer_problems,
                                   recompute_problems, sequence_parallel_on)
from engine.training.rank_batch import build_rank_batch, pad_multiple
from models.estimate.training_memory import GIB
from engine.config.recipe_validation import MODEL_SHAPES, estimate_memory
from parallel.layout import ParallelLayout


def train(recompute="none", method=None, layers=None, **kw):
    return SimpleNamespace(recompute=recompute, recompute_method=method,
                           recompute_num_layers=layers, micro_batch_size=1,
                           max_tokens_per_micro_batch=None, seq_length=4096, **kw)


def parallel(tp=1, sp=None, pp=1, vpp=None):
    return SimpleNamespace(tp=tp, sequence_parallel=sp, pp=pp, vpp=vpp)


# ------------------------------------------------------------------ keys -> TransformerConfig

def test_sequence_parallel_default_is_on_exactly_when_tp_above_1():
    assert sequence_parallel_on(parallel(tp=1)) is False
    assert sequence_parallel_on(parallel(tp=2)) is True
    assert sequence_parallel_on(parallel(tp=8, sp=False)) is False
    assert sequence_parallel_on(parallel(tp=2, sp=True)) is True


def test_megatron_overrides():
    assert megatron_overrides(parallel(tp=2)) == {"sequence_parallel": True}
    assert megatron_overrides(parallel(tp=1), train()) == {"sequence_parallel": False}
    assert megatron_overrides(parallel(tp=2), train("selective")) == {
        "sequence_parallel": True, "recompute_granularity": "selective"}
    assert megatron_overrides(parallel(tp=1), train("full")) == {
        "sequence_parallel": False, "recompute_granularity": "full",
        "recompute_method": "uniform", "recompute_num_layers": 1}
    assert megatron_overrides(parallel(tp=4, sp=False), train("full", "block", 3)) == {
        "sequence_parallel": False, "recompute_granularity": "full",
        "recompute_method": "block", "recompute_num_layers": 3}


def test_megatron_accepts_the_overrides():
    """Megatron's own TransformerConfig checks (e.g. selective needs recompute_num_layers
    None, full needs a method) accept every mapping."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    seen = []
    for t in (train(), train("selective"), train("full"), train("full", "block", 2)):
        cfg = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8,
                                tensor_model_parallel_size=2,
                                **megatron_overrides(parallel(tp=2), t))
        assert cfg.sequence_parallel
        assert cfg.recompute_granularity == (None if t.recompute == "none" else t.recompute)
        seen.append(describe(cfg))
    assert seen == ["sequence parallelism on, recompute none",
                    "sequence parallelism on, recompute selective (core_attn)",
                    "sequence parallelism on, recompute full (uniform, 1 layer(s))",
                    "sequence parallelism on, recompute full (block, 2 layer(s))"]


# ------------------------------------------------------------------ validation

def test_recompute_value_problems_name_the_key_and_choices():
    assert recompute_problems(train()) == []
    assert recompute_problems(train("full", "block", 2)) == []
    assert recompute_problems(train("partial")) == [
        "train.recompute='partial' is not valid; choose one of none, selective, full"]
    assert recompute_problems(train("selective", "block")) == [
        "train.recompute_method='block' applies only to train.recompute=full (got "
        "train.recompute=selective); remove it or use full"]
    assert recompute_problems(train("none", None, 2)) == [
        "train.recompute_num_layers=2 applies only to train.recompute=full (got "
        "train.recompute=none); remove it or use full"]
    assert recompute_problems(train("full", "every", 0)) == [
        "train.recompute_method='every' is not valid; choose one of uniform, block (or "
        "null: uniform)",
        "train.recompute_num_layers=0 must be null or an integer >= 1"]


def test_recompute_layers_against_the_pipeline_chunk():
    # 8 layers, pp 2 x vpp 2: chunks of 2 layers
    p = parallel(pp=2, vpp=2)
    assert recompute_layer_problems(p, train("full", "uniform", 2), 8) == []
    assert recompute_layer_problems(p, train("full", "uniform", 3), 8) == [
        "train.recompute_num_layers=3 must divide the 2 layers of each pipeline chunk "
        "(num_hidden_layers=8 / (parallel.pp x parallel.vpp = 4)) with "
        "train.recompute_method=uniform; valid: [1, 2]"]
    assert recompute_layer_problems(p, train("full", "block", 3), 8) == [
        "train.recompute_num_layers=3 exceeds the 2 layers of each pipeline chunk "
        "(num_hidden_layers=8 / (parallel.pp x parallel.vpp = 4)) with "
        "train.recompute_method=block; valid: 1..2"]
    assert recompute_layer_problems(parallel(), train("selective"), 8) == []
    assert recompute_layer_problems(parallel(pp=3), train("full", "uniform", 3), 8) == []


def test_config_keys_exist_and_sft_problems_reports_them():
    cfg, _ = load_config(SFTConfig, ["train.recompute=sometimes",
                                     "parallel.sequence_parallel=true"])
    assert cfg.parallel.sequence_parallel is True
    assert cfg.train.recompute_method is None and cfg.train.recompute_num_layers is None
    assert "train.recompute='sometimes' is not valid; choose one of none, selective, full" in (
        sft_problems(cfg))


def test_layout_refuses_sp_without_tp_and_uneven_sequences():
    assert ParallelLayout(2, tp=1, sequence_parallel=True).problems() == [
        "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits activations over "
        "the tensor-parallel ranks); use null (on whenever tp > 1) or false, or raise "
        "parallel.tp"]
    assert ParallelLayout(4, tp=4, sequence_parallel=True).problems(seq_length=4096) == []
    assert ParallelLayout(4, tp=4, sequence_parallel=True).problems(seq_length=1022) == [
        "train.seq_length=1022 must be divisible by parallel.tp = 4 (sequence parallelism "
        "over TP); nearest valid: 1020 or 1024"]
    assert ParallelLayout(8, tp=2, cp=2, sequence_parallel=True).problems(seq_length=100) == [
        "train.seq_length=100 must be divisible by 2 x parallel.cp x parallel.tp = 8 (zigzag "
        "context-parallel sharding, then sequence parallelism over TP); nearest valid: 96 or "
        "104"]
    # without sequence parallelism TP does not constrain the length
    assert ParallelLayout(8, tp=2, cp=2).problems(seq_length=100) == []


# ------------------------------------------------------------------ padding

def test_pad_multiple():
    assert pad_multiple(1, 4, False) == 1
    assert pad_multiple(1, 4, True) == 4
    assert pad_multiple(2, 2, False) == 4
    assert pad_multiple(2, 2, True) == 8


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_micro_batches_split_evenly_over_tp(packing, cp):
    """With sequence parallelism every micro-batch's CP shard divides by tp (megatron splits
    it along the sequence); padding carries weight 0, so the weighted token sum over the CP
    ranks is the same as without sequence parallelism."""
    lengths = [7, 13, 5, 22, 9]
    seqs = [SequenceData(list(range(3, 3 + n)), list(range(4, 4 + n)), [1] * n)
            for n in lengths]
    cfg = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                          balance_dp=False, packing=packing)
    weights = torch.ones(len(seqs), dtype=torch.float64)
    total = {False: 0.0, True: 0.0}
    for cp_rank in range(cp):
        layout = dict(dp=1, dp_rank=0, cp=cp, cp_rank=cp_rank, tp=4, pp=1, dp_group=None)
        plain = build_rank_batch(seqs, weights, cfg, layout=layout)
        sp = build_rank_batch(seqs, weights, cfg, layout=layout, sequence_parallel=True)
        for mb in sp.micro_batches:
            assert mb.tokens.shape[1] % 4 == 0
            if packing:  # every packed segment is padded to 2 x cp x tp (or tp)
                cu = mb.packed_seq_params.cu_seqlens_q
                assert all(int(n) % pad_multiple(cp, 4, True) == 0 for n in cu[1:] - cu[:-1])
        for on, batch in ((False, plain), (True, sp)):
            total[on] += sum(float(mb.token_weights.sum()) for mb in batch.micro_batches)
        assert sp.num_padding > plain.num_padding
    assert total[True] == total[False] == sum(lengths)


def test_sequence_parallel_without_tp_in_layout_is_an_error():
    seqs = [SequenceData([1, 2, 3], [2, 3, 4], [1, 1, 1])]
    cfg = SimpleNamespace(micro_batch_size=1, max_tokens_per_micro_batch=None,
                          balance_dp=False, packing=False)
    layout = dict(dp=1, dp_rank=0, cp=1, cp_rank=0, pp=1, dp_group=None)
    with pytest.raises(KeyError):
        build_rank_batch(seqs, GlobalLossNormalizer("token-sum"), cfg, layout=layout,
                         sequence_parallel=True)


# ------------------------------------------------------------------ norm of the local spec

def test_local_norm_tags_its_weights_only_with_sequence_parallelism():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.layers.spec import layer_spec
    from models.layers.norms.local import LocalNorm

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                tensor_model_parallel_size=2, normalization="RMSNorm", qk_layernorm=True)
    on = TransformerConfig(sequence_parallel=True, **base)
    off = TransformerConfig(sequence_parallel=False, **base)
    norm = LocalNorm(on, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel is True
    assert not hasattr(LocalNorm(off, 64).weight, "sequence_parallel")
    x = torch.randn(5, 64)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))
    spec = layer_spec(on, use_te=False).submodules
    assert spec.input_layernorm is LocalNorm and spec.pre_mlp_layernorm is LocalNorm
    assert spec.self_attention.submodules.q_layernorm is LocalNorm


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_local_norm_weights_are_in_the_model_dtype(normalization):
    """bf16 models got fp32 norm weights (torch's default dtype): on GPUs torch then skips
    its fused norm kernel ("Mismatch dtype between input and weight"), seen on an H100."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.layers.norms.local import LocalNorm

    for dtype in (torch.bfloat16, torch.float32):
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                                   normalization=normalization, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16)
        norm = LocalNorm(config, 64, eps=1e-6)
        assert {p.dtype for p in norm.parameters()} == {dtype}
        assert norm(torch.randn(3, 64, dtype=dtype)).dtype == dtype


# ------------------------------------------------------------------ memory estimate

def test_memory_factors_of_sequence_parallelism_and_recompute():
    """Llama-3.1-8B, TP2 x DP4, one 4096-token sequence per micro-batch, bf16 (a = 2), all
    32 layers on the stage: the factors of engine.config.recipe_validation's docstring."""
    hf = MODEL_SHAPES["llama-3.1-8b"]
    h, q, kv, ffn, layers, t, a = 4096, 4096, 1024, 14336, 32, 4096, 2

    def act(sp, t_cfg):
        layout = ParallelLayout(8, tp=2, sequence_parallel=sp)
        return estimate_memory(hf, layout, t_cfg, True, True, 32).activations * GIB

    kv_rep = 2 * q
    per_layer = a * t * (4 * h + (q + kv_rep + q + 2 * kv + 3 * ffn) / 2)
    per_layer_sp = a * t * (4 * h / 2 + (q + kv_rep + q + 2 * kv + 3 * ffn) / 2)
    assert act(False, train()) == pytest.approx(layers * per_layer)
    assert act(True, train()) == pytest.approx(layers * per_layer_sp)
    # selective: the attention core's repeated KV is not kept
    assert act(True, train("selective")) == pytest.approx(
        layers * (per_layer_sp - a * t * kv_rep / 2))
    # full uniform, groups of 1: every layer keeps its input; one layer rebuilt at a time
    layer_input = a * t * h / 2
    assert act(True, train("full")) == pytest.approx(layers * layer_input + per_layer_sp)
    assert act(True, train("full", "uniform", 4)) == pytest.approx(
        layers / 4 * layer_input + 4 * per_layer_sp)
    # block of 8 of the 32 layers: those keep their input, the other 24 everything
    assert act(True, train("full", "block", 8)) == pytest.approx(
        8 * layer_input + 24 * per_layer_sp + per_layer_sp)
    ordered = [act(False, train()), act(True, train()), act(True, train("selective")),
               act(True, train("full", "block", 8)), act(True, train("full"))]
    assert ordered == sorted(ordered, reverse=True)
    assert act(False, train()) / act(True, train("full")) > 10


# ------------------------------------------------------------------ CPU host runtime

CUSTOM_BACKWARD_ON_CPU = """
import torch
from parallel import cpu_runtime

cpu_runtime.install()
assert cpu_runtime.is_cpu_host()


class Double(torch.autograd.Function):
    # like megatron's sequence-parallel linears: a buffer on the current CUDA device in backward
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        buf = torch.empty(grad.shape, device=torch.cuda.current_device())
        return buf.copy_(grad * 2)


x = torch.ones(3, requires_grad=True)
torch.autograd.backward(Double.apply(x).sum())  # called through the mode, as megatron does
print("grad", x.grad.tolist())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runtime is a no-op with CUDA")
def test_cpu_runtime_maps_cuda_devices_inside_custom_backward(pools, tmp_path):
    """parallel.cpu_runtime keeps mapping CUDA devices to the CPU inside the backward of
    Python autograd Functions (the mode is popped while its own handler runs
    torch.autograd.backward); in a rank of the session's 1-rank pool (the runtime installed
    as in a launch), so this test's install stays out of the test process."""
    script = tmp_path / "custom_backward.py"
    script.write_text(CUSTOM_BACKWARD_ON_CPU)
    proc = pools.script(1, str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "grad [2.0, 2.0, 2.0]" in proc.stdout
