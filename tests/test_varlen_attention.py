"""Packed attention's dispatch to torch's varlen kernel (models/layers/attention/varlen.py), on
the CPU: what the core attention hands `varlen_attn` on a CUDA-like device (the device check
patched to accept `meta` or the CPU, the kernel replaced by a recorder or by the kernel's
contract, tools.bench.gpu.varlen_check.varlen_reference), and what keeps the per-segment loop
(sinks, CPU tensors, fp32, MLA's value heads). The kernel itself runs on a card only:
`python -m tools.bench gpu --items varlen` compares it with the loop there."""
from __future__ import annotations

import json

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from models.layers.attention import core, varlen
from models.layers.attention.core import SDPACoreAttention
from parallel.packed_seqs import packed_seq_params
from tools.bench.gpu.items import build_items
from tools.bench.gpu.report import read_metrics, table
from tools.bench.gpu.varlen_check import Case, loop_attention, varlen_reference

BOUNDS = [0, 5, 5, 17, 40]   # an empty segment included; the longest is 23
HEADS, KV, DIM = 4, 2, 16


def attention(window_left=None, kv=KV) -> SDPACoreAttention:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=kv, kv_channels=DIM,
                               window_size=None if window_left is None else (window_left, 0))
    return SDPACoreAttention(config, 1, None, "self")


def qkv(device="cpu", dtype=torch.float32, kv=KV, t=BOUNDS[-1], seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, DIM, generator=gen).to(device, dtype)
                 for h in (HEADS, kv, kv))


class Recorder:
    """Stands in for varlen_attn: records its arguments, returns an output of query's shape."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        self.calls.append(dict(query=query, key=key, value=value, cu_seq_q=cu_seq_q,
                               cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k, **kwargs))
        return torch.zeros_like(query)


@pytest.fixture
def on_meta(monkeypatch):
    """`meta` tensors count as a flash-capable CUDA device; the kernel is a Recorder."""
    recorder = Recorder()
    monkeypatch.setattr(varlen, "flash_device", lambda device: device.type == "meta")
    monkeypatch.setattr(varlen, "varlen_attn", recorder)
    return recorder


@pytest.mark.parametrize("window_left,kv", [(None, KV), (7, KV), (None, HEADS)])
def test_the_kernel_gets_device_int32_bounds_host_max_window_and_unrepeated_kv(
        on_meta, window_left, kv):
    module = attention(window_left, kv)
    q, k, v = qkv("meta", torch.bfloat16, kv)
    params = packed_seq_params(BOUNDS)   # boundaries on the host: copied to the query's device
    out = module(q, k, v, packed_seq_params=params)
    assert out.shape == (BOUNDS[-1], HEADS * DIM) and out.device.type == "meta"
    (call,) = on_meta.calls   # one call for the whole row
    assert call["query"] is q and call["key"] is k and call["value"] is v  # GQA: no repeat
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].device.type == "meta"
    assert call["cu_seq_q"].shape == (len(BOUNDS),) and call["cu_seq_k"] is call["cu_seq_q"]
    assert (call["max_q"], call["max_k"]) == (23, 23)
    assert all(type(call[m]) is int for m in ("max_q", "max_k"))   # host ints: no device read
    assert call["window_size"] == ((-1, 0) if window_left is None else (window_left, 0))
    assert type(call["window_size"]) is tuple   # varlen_attn's is_causal is `== (-1, 0)`
    assert call["enable_gqa"] is (kv != HEADS) and call["scale"] == DIM ** -0.5
    # boundaries already on the device (the engine moves PackedSeqParams with the batch): reused
    params.cu_seqlens_q = torch.tensor(BOUNDS, dtype=torch.int32, device="meta")
    module(q, k, v, packed_seq_params=params)
    assert on_meta.calls[-1]["cu_seq_q"] is params.cu_seqlens_q


def test_the_arguments_hold_the_host_boundaries():
    q, k, _ = qkv()
    call = varlen.varlen_call(q, k, BOUNDS, 0.5, None)
    assert call.cu_seq_q.tolist() == BOUNDS and call.cu_seq_q.dtype == torch.int32
    assert (call.max_q, call.window_size, call.enable_gqa) == (23, (-1, 0), True)
    int64 = torch.tensor(BOUNDS)   # not the kernel's dtype: rebuilt from the host ints
    assert varlen.varlen_call(q, k, BOUNDS, 0.5, 3, int64).cu_seq_q.dtype == torch.int32
    short = torch.tensor(BOUNDS[:-1], dtype=torch.int32)   # another row's: not reused
    assert varlen.varlen_call(q, k, BOUNDS, 0.5, 3, short).cu_seq_q.tolist() == BOUNDS


def test_what_the_kernel_does_not_cover_keeps_the_loop(on_meta, monkeypatch):
    q, k, v = qkv("meta", torch.bfloat16)
    assert varlen.varlen_refusal(q, k, v, has_sinks=False) is None
    assert varlen.varlen_refusal(q, k, v, has_sinks=True) == "learned attention sinks"
    assert varlen.varlen_refusal(*qkv("meta", torch.float32), False).startswith(
        "dtype torch.float32")
    mla_v = torch.empty(q.shape[0], KV, 8, device="meta", dtype=torch.bfloat16)
    assert varlen.varlen_refusal(q, k, mla_v, False).startswith("head dims [8, 16]")
    assert varlen.varlen_refusal(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1),
                                 False) == "4 query heads over 3 KV heads"
    monkeypatch.undo()   # the real device check: CPU and meta tensors are no CUDA device
    assert varlen.varlen_refusal(*qkv("cpu", torch.bfloat16), False).startswith("cpu tensors")
    assert not varlen.uses_varlen(q, k, v, has_sinks=False)


def test_sinks_and_cpu_tensors_run_the_segment_loop(monkeypatch):
    """Learned sinks on a kernel-capable device, and plain CPU tensors: the loop, never the
    kernel; the negative control shows the kernel is called once the predicate allows it."""
    recorder = Recorder()
    monkeypatch.setattr(varlen, "varlen_attn", recorder)
    module = attention(window_left=7)
    q, k, v = qkv()
    params = packed_seq_params(BOUNDS)
    loop = loop_attention(q, k, v, BOUNDS, module.scale, Case("w", HEADS, KV, 7))
    torch.testing.assert_close(module(q, k, v, packed_seq_params=params).view_as(q), loop)
    monkeypatch.setattr(varlen, "flash_device", lambda device: True)
    monkeypatch.setattr(varlen, "KERNEL_DTYPES", (torch.float32,))
    module.register_parameter("softmax_offset", torch.nn.Parameter(torch.zeros(HEADS)))
    module(q, k, v, packed_seq_params=params)
    assert recorder.calls == []
    module.softmax_offset = None   # negative control: without sinks the kernel is called
    module(q, k, v, packed_seq_params=params)
    assert len(recorder.calls) == 1


@pytest.mark.parametrize("window_left,kv", [(None, KV), (7, KV), (0, KV), (None, HEADS)])
def test_the_kernel_contract_fed_these_arguments_equals_the_loop(monkeypatch, window_left, kv):
    """The core attention's varlen path with the kernel replaced by its contract (one dense
    masked SDPA built from cu_seq, max lengths, window_size, enable_gqa) gives the loop's
    output and gradients; a window one key wider, or no causal mask, would not (controls)."""
    monkeypatch.setattr(varlen, "flash_device", lambda device: True)
    monkeypatch.setattr(varlen, "KERNEL_DTYPES", (torch.float32,))
    monkeypatch.setattr(varlen, "varlen_attn", varlen_reference)
    module = attention(window_left, kv)
    inputs = [x.requires_grad_() for x in qkv(kv=kv, seed=1)]
    params = packed_seq_params(BOUNDS)
    got = module(*inputs, packed_seq_params=params).view_as(inputs[0])
    want = loop_attention(*inputs, BOUNDS, module.scale, Case("c", HEADS, kv, window_left))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs,
                                                                                 grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    call = varlen.varlen_call(inputs[0], inputs[1], BOUNDS, module.scale, window_left)
    args = (*inputs, call.cu_seq_q, call.cu_seq_k, call.max_q, call.max_k)
    wrong = [(-1, -1)] + ([] if window_left is None else [(window_left + 1, 0)])
    for window in wrong:   # negative controls: what a wrong window_size would give
        off = varlen_reference(*args, **{**call.kwargs(), "window_size": window}) - want
        assert off.abs().max() > 1e-2
    with pytest.raises(ValueError, match="the longest segment is 23"):
        varlen_reference(*inputs, call.cu_seq_q, call.cu_seq_k, 22, 22, **call.kwargs())


def test_cpu_training_never_calls_the_kernel(monkeypatch):
    """The real predicate on the CPU (the suite's runs): the loop, kernel untouched."""
    monkeypatch.setattr(varlen, "varlen_attn", Recorder())
    q, k, v = qkv(dtype=torch.bfloat16)
    out = attention()(q, k, v, packed_seq_params=packed_seq_params(BOUNDS))
    assert varlen.varlen_attn.calls == [] and out.dtype == torch.bfloat16
    assert core.uses_varlen is varlen.uses_varlen


def test_compiled_layers_call_the_kernel_once_per_packing_without_retracing(monkeypatch):
    """The dispatch under torch.compile adds no graph: the predicate traces (the device
    capability a dynamo constant) and the kernel call stays eager, one call per forward, for
    three different packings. (models.build.compile_layers never traces a packed row at all:
    packed micro-batches take the core attention's eager forward; this guards the dispatch for
    a caller that does compile around it.)"""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(varlen, "flash_device",
                        lambda device: device.type == "meta" and varlen.flash_capable(0))
    recorder = Recorder()
    monkeypatch.setattr(varlen, "varlen_attn", recorder)
    module = attention(window_left=7)
    module.packed_attention = torch.compiler.disable(module.packed_attention)
    q, k, v = qkv("meta", torch.bfloat16)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(module, backend="eager")
    for bounds in (BOUNDS, [0, 3, 40], [0, 1, 2, 40]):
        compiled(q, k, v, packed_seq_params=packed_seq_params(bounds))
    assert [c["max_q"] for c in recorder.calls] == [23, 37, 38]
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_the_gpu_item_runs_the_check_and_reports_each_case(tmp_path):
    (gpu,) = build_items(["varlen"], tmp_path, smoke=False)
    (smoke,) = build_items(["varlen"], tmp_path, smoke=True)
    assert gpu.commands[0][2:] == ["tools.bench.gpu.varlen_check", "--json",
                                   str(tmp_path / "varlen.json")]
    assert smoke.commands[0][-1] == "--smoke" and "cuda" in gpu.needs
    assert "cuda" not in smoke.needs
    case = dict(case="causal_gqa", path="varlen", segments=50, candidate_ms=1.5, loop_ms=12.0,
                speedup=8.0, max_abs_diff={"out": 0.0078, "dq": 0.0156}, ok=True,
                err_candidate={"out": 0.004}, err_loop={"out": 0.004})
    gpu.result.write_text(json.dumps({"device": "H100", "results": [
        case, dict(case, case="window_gqa", path="cpu tensors", ok=False)]}))
    metrics = read_metrics(gpu)
    assert len(metrics["problems"]) == 1 and metrics["problems"][0].startswith(
        "varlen window_gqa: path cpu tensors")   # not the kernel on a card: a problem
    assert table([{"item": "varlen", "status": "ok", "metrics": metrics}]).splitlines()[-1] \
        .startswith("| varlen | ok |  |  | causal_gqa (50 segments): varlen 1.50 ms vs loop "
                    "12.00 ms (x8.00), max |diff| out 7.8e-03, dq 1.6e-02; window_gqa")
