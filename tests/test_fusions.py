"""Fusions without Transformer Engine (engine.config.fusion_settings, keys model.fusions.*)
against the unfused math on the CPU, forward and backward, fp32 rel 1e-5:

- swiglu: megatron's fused SwiGLU (plain and routing-weighted, with its hand-written
  backward) vs chunk + silu * up (megatron MLP's unfused path);
- residual: megatron's fused bias-dropout-add vs its unfused one;
- rmsnorm: models.layers.norms.local.rms_norm (eager) and FusedRMSNorm (torch.compile, in a plain process:
  on CPU hosts the engine refuses it, parallel.cpu_runtime's device mode) vs torch.nn.RMSNorm.
Negative controls: a SwiGLU with gate and up swapped, an RMSNorm without the eps, are seen.
The whole-model check with swiglu and residual on is in tests/test_grouped_experts.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import parallel  # noqa: F401  (megatron's jit fuser off on this CPU host, as in the engine)

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _grads(fn, *inputs):
    """fn(*inputs) and the gradients of its inputs under a fixed output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.sin(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


def _swiglu(y):
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _max_rel(got, ref) -> float:
    return max(_rel(a, b) for a, b in zip(got, ref))


def test_fused_swiglu_matches_unfused():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    y = torch.randn(37, 48, generator=torch.Generator().manual_seed(0)) * 3
    ref = _grads(_swiglu, y)
    assert _max_rel(_grads(lambda t: bias_swiglu_impl(t, None), y), ref) <= TOL
    swapped = _grads(lambda t: _swiglu(torch.cat(torch.chunk(t, 2, -1)[::-1], -1)), y)
    assert _max_rel(swapped, ref) > 0.1  # negative control


def test_fused_weighted_swiglu_matches_unfused():
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    gen = torch.Generator().manual_seed(1)
    y, probs = torch.randn(29, 48, generator=gen) * 3, torch.rand(29, generator=gen)
    ref = _grads(lambda t, p: (_swiglu(t) * p.unsqueeze(-1)).to(t.dtype), y, probs)
    got = _grads(lambda t, p: weighted_bias_swiglu_impl(t, None, p.unsqueeze(-1)), y, probs)
    assert _max_rel(got, ref) <= TOL


def test_fused_residual_matches_unfused():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen)
    fused, unfused = get_bias_dropout_add(True, True), get_bias_dropout_add(True, False)
    got = _grads(lambda a, r: fused((a, None), r, 0.0), x, residual)
    ref = _grads(lambda a, r: unfused((a, None), r, 0.0), x, residual)
    assert _max_rel(got, ref) <= TOL
    assert _rel(got[0], x + residual) <= TOL


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_torch(dtype, tol):
    from models.layers.norms.local import rms_norm

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 19, 64, generator=gen) * 4).to(dtype)
    norm = torch.nn.RMSNorm(64, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    ref = _grads(lambda t, w: F.rms_norm(t, (64,), w, 1e-6), x, norm.weight)
    assert _max_rel(_grads(lambda t, w: rms_norm(t, w, 1e-6), x, norm.weight), ref) <= tol
    if dtype == torch.float32:  # negative control: eps dropped is visible at small inputs
        small = x * 1e-3
        assert _rel(rms_norm(small, norm.weight, 0.0), F.rms_norm(small, (64,), norm.weight,
                                                                  1e-6)) > 1e-3


COMPILED_CHECK = """
import torch, torch.nn.functional as F
from models.layers.norms.local import FusedRMSNorm
gen = torch.Generator().manual_seed(4)
norm = FusedRMSNorm(64, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(64, generator=gen))
worst = 0.0
for rows in (7, 33):  # two sequence lengths: one dynamic-shape graph
    x = torch.randn(rows, 2, 64, generator=gen) * 3
    g = torch.randn(rows, 2, 64, generator=gen)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    out = norm(a); out.backward(g)
    ref = F.rms_norm(b, (64,), w, 1e-6); ref.backward(g)
    for p, q in ((out, ref), (a.grad, b.grad), (norm.weight.grad, w.grad)):
        worst = max(worst, ((p - q).abs().max() / q.abs().max()).item())
    norm.weight.grad = None
print("REL", worst)
"""


def test_compiled_rms_norm_matches_torch_on_cpu():
    """torch.compile (Inductor, C++ on this host) of FusedRMSNorm: ~35 s on 2 cores."""
    proc = subprocess.run([sys.executable, "-c", COMPILED_CHECK], cwd=ROOT, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = float(proc.stdout.split("REL")[-1])
    assert rel <= TOL, rel


def _cfg(**fusions):
    from engine.config.fusion_settings import FusionConfig

    return SimpleNamespace(model=SimpleNamespace(fusions=FusionConfig(**fusions)))


def test_fusion_keys_resolve_and_are_validated():
    from engine.config.fusion_settings import fusion_overrides, fusion_problems

    silu, gelu = {"hidden_act": "silu"}, {"hidden_act": "gelu"}
    # off by default on every host (slower on an H100, docs/benchmarks.md), null too
    assert fusion_overrides(_cfg(), silu) == dict(
        bias_activation_fusion=False, bias_dropout_fusion=False, fused_norm=False)
    assert fusion_overrides(_cfg(swiglu=None, residual=None, rmsnorm=None), silu) == dict(
        bias_activation_fusion=False, bias_dropout_fusion=False, fused_norm=False)
    assert fusion_overrides(_cfg(swiglu=True, residual=True, rmsnorm=True), silu) == dict(
        bias_activation_fusion=True, bias_dropout_fusion=True, fused_norm=True)
    assert fusion_overrides(_cfg(), silu) == dict(
        bias_activation_fusion=False, bias_dropout_fusion=False, fused_norm=False)
    assert fusion_overrides(_cfg(swiglu=True, rmsnorm=False), silu) == dict(
        bias_activation_fusion=True, bias_dropout_fusion=False, fused_norm=False)
    # megatron's fused GeGLU is gelu's tanh approximation: never for HF's exact gelu
    assert not fusion_overrides(_cfg(swiglu=True), gelu)["bias_activation_fusion"]
    assert fusion_problems(_cfg(swiglu=True, residual=False)) == []
    assert fusion_problems(_cfg(rmsnorm=True)) == []   # the CPU runtime too (torch >= 2.13)
    (problem,) = fusion_problems(_cfg(swiglu="on"))
    assert problem.startswith("model.fusions.swiglu='on' must be")


def test_fusion_keys_on_the_command_line():
    from engine.config.schema import SFTConfig, load_config

    cfg, _ = load_config(SFTConfig, ["model.fusions.swiglu=false", "model.fusions.rmsnorm=true"])
    assert cfg.model.fusions.swiglu is False and cfg.model.fusions.rmsnorm is True
    assert cfg.model.fusions.residual is False
    with pytest.raises(Exception, match="fusions"):
        load_config(SFTConfig, ["model.fusions.rope=true"])
