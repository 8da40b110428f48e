"""optim.name=muon (engine.training.muon, engine.config.optim_settings; docs/optimizers.md),
in-process: the typing.override shim, megatron-core's TensorParallelMuon against the plain
formulas of tests/muon_reference.py, the keys' validation. The engine-level checks (1 process
against the formulas, DP2 / TP2 / PP2 / EP2 against 1 process, Muon differs from AdamW) run in
tests/test_sft_invariance.py's launches (flag `muon`)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import typing
from types import SimpleNamespace

import pytest
import torch

from engine.config.optim_settings import MuonConfig, OptimConfig, optim_problems
from engine.training import muon as muon_mod
from tests.muon_reference import QUINTIC, newton_schulz, orthogonalized_update

needs_package = pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is None,
                                   reason="emerging-optimizers is not installed "
                                          "(bash tools/install.sh)")


def test_typing_override_shim_is_needed_and_enough():
    """Fails when the shim is no longer needed (the interpreter has typing.override: drop
    ensure_typing_override) or no longer enough (emerging-optimizers' orthogonalized
    optimizers, what megatron-core's Muon imports, do not import with it). Runs in a fresh
    interpreter, so that no earlier import has added the attribute."""
    code = ("import typing; had = hasattr(typing, 'override'); "
            "from engine.training.muon import ensure_typing_override; "
            "added = ensure_typing_override(); "
            "import emerging_optimizers.orthogonalized_optimizers as o; "
            "print(had, added, hasattr(o, 'OrthogonalizedOptimizer'))")
    if importlib.util.find_spec("emerging_optimizers") is None:
        pytest.skip("emerging-optimizers is not installed (bash tools/install.sh)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    had, added, have = out.stdout.split()[-3:]
    assert had == "False", (f"Python {sys.version_info[:2]} has typing.override: the shim in "
                            "engine.training.muon is no longer needed")
    assert (added, have) == ("True", "True"), out.stdout


def test_shim_adds_nothing_when_typing_has_override(monkeypatch):
    monkeypatch.setattr(typing, "override", lambda f: f, raising=False)
    assert muon_mod.ensure_typing_override() is False


def test_reference_newton_schulz_equals_emerging_optimizers():
    muon_mod.muon_module()
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import (_COEFFICIENT_SETS,
                                                                          newton_schulz as ns)
    assert tuple(_COEFFICIENT_SETS["quintic"]) == QUINTIC
    g = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    for x in (g, g.T.contiguous()):
        torch.testing.assert_close(newton_schulz(x), ns(x, 5, "quintic"), rtol=1e-5, atol=1e-6)


@needs_package
@pytest.mark.parametrize("split", [False, True])
def test_tensor_parallel_muon_equals_the_formulas(split):
    """megatron-core's TensorParallelMuon (with the engine's keyword adaptation where
    megatron-core 0.16.1 needs it), 3 steps on a fused QKV-shaped matrix, fp32: equal to
    momentum, Newton-Schulz and the spectral scale written out, and Q/K/V split differs from
    the whole-matrix update."""
    module = muon_mod.muon_module()
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(2 * (4 + 2 + 2), 12, generator=gen)   # 2 groups of q 4, k 2, v 2 rows
    grads = [torch.randn(w0.shape, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    p.is_qkv = True
    opt = module.TensorParallelMuon([p], lr=0.05, momentum_beta=0.9, use_nesterov=False,
                                    weight_decay=0.1, split_qkv=split,
                                    is_qkv_fn=lambda t: getattr(t, "is_qkv", False),
                                    qkv_split_shapes=(4, 2, 2), fp32_matmul_prec="highest",
                                    num_ns_steps=5, scale_mode="spectral")
    ref, m = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        ref.mul_(1 - 0.05 * 0.1)
        m = 0.9 * m + 0.1 * g
        ref -= 0.05 * orthogonalized_update(m, 5, 1.0, (4, 2, 2) if split else None)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-6)
    whole = orthogonalized_update(m, 5, 1.0, None)
    assert (whole - orthogonalized_update(m, 5, 1.0, (4, 2, 2))).abs().max() > 0.1


def test_defaults_are_megatron_cores_except_tp_mode():
    from megatron.core.optimizer import OptimizerConfig

    mc, ours = OptimizerConfig(), MuonConfig()
    for key, value in muon_mod.muon_config_kwargs(ours).items():
        if key == "muon_tp_mode":
            assert (getattr(mc, key), value) == ("blockwise", "duplicated")
        else:
            assert getattr(mc, key) == value, key


@pytest.mark.parametrize("key,value,needle", [
    ("name", "sgd", "optim.name='sgd' is not one of adamw, muon"),
    ("muon.tp_mode", "rowwise", "optim.muon.tp_mode='rowwise' is not one of duplicated, "
                                "distributed, blockwise"),
    ("muon.scale_mode", "rms", "optim.muon.scale_mode='rms' is not one of spectral, "
                               "unit_rms_norm, shape_scaling"),
    ("muon.ns_steps", 0, "optim.muon.ns_steps=0 must be an integer >= 1"),
    ("muon.momentum", 1.0, "optim.muon.momentum=1.0 must be in [0, 1)"),
    ("muon.fp32_matmul_prec", "low", "optim.muon.fp32_matmul_prec='low' is not one of"),
    ("qk_clip", True, "optim.qk_clip=true is not supported"),
])
def test_bad_values_are_refused_by_name(key, value, needle):
    optim = OptimConfig(distributed_optimizer=False)
    target = optim.muon if key.startswith("muon.") else optim
    setattr(target, key.split(".")[-1], value)
    problems = optim_problems(optim)
    assert len(problems) == 1 and needle in problems[0], problems


def test_muon_takes_the_layer_wise_distributed_optimizer_and_refuses_a_missing_package(
        monkeypatch):
    """optim.distributed_optimizer=true with Muon is megatron-core's layer-wise distributed
    optimizer (DDP then runs without megatron's ZeRO-style one, and its parameter-gather
    overlap is refused by name); a missing emerging-optimizers is refused by name."""
    from engine.training.muon import layer_wise_muon, megatron_distributed_optimizer
    from engine.config.parallel_settings import ParallelConfig, overlap_problems

    if importlib.util.find_spec("emerging_optimizers") is not None:
        for distributed in (False, True):
            assert optim_problems(OptimConfig(name="muon",
                                              distributed_optimizer=distributed)) == []
    muon, adamw = OptimConfig(name="muon"), OptimConfig()
    assert layer_wise_muon(muon) and not megatron_distributed_optimizer(muon)
    assert megatron_distributed_optimizer(adamw) and not layer_wise_muon(adamw)
    gather = ParallelConfig(overlap_param_gather=True)
    (p,) = overlap_problems(SimpleNamespace(parallel=gather, optim=muon))
    assert p.startswith("parallel.overlap_param_gather=true needs optim.distributed_optimizer="
                        "true with optim.name=adamw"), p
    assert overlap_problems(SimpleNamespace(parallel=gather, optim=adamw)) == []
    monkeypatch.setattr("engine.config.optim_settings.emerging_optimizers_installed",
                        lambda: False)
    problems = optim_problems(OptimConfig(name="muon", distributed_optimizer=False))
    assert problems == ["optim.name=muon needs emerging-optimizers==0.3.0, which is not "
                        f"installed: {muon_mod.INSTALL_HINT}"]
    assert optim_problems(OptimConfig()) == []


def test_validate_memory_counts_muons_state():
    """--validate's estimate with optim.name=muon: AdamW's 12 bytes (bf16: fp32 master, m, v)
    for the embedding, output layer and final norm, 8 (fp32 master, momentum) for the layers'
    parameters; 4 vs 8 in fp32; with the layer-wise distributed optimizer all of it divided by
    dp x cp."""
    from engine.config.recipe_validation import estimate_memory
    from models.estimate.counting import stage_parameters
    from models.estimate.training_memory import GIB
    from parallel.layout import ParallelLayout
    from types import SimpleNamespace

    hf = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 4, "vocab_size": 256, "tie_word_embeddings": False,
          "max_position_embeddings": 4096}
    train = SimpleNamespace(seq_length=256, micro_batch_size=1, max_tokens_per_micro_batch=None,
                            loss_chunk_tokens=None, recompute="none", recompute_method=None,
                            recompute_num_layers=None)
    layout = ParallelLayout(2, tp=2, sequence_parallel=True)
    n = stage_parameters(hf, 2, 1).first_stage
    vectors = 2 * 256 * 64 // 2 + 64        # embedding + output over tp 2, the final norm
    for bf16, adam, muon in ((True, 12, 8), (False, 8, 4)):
        plain = estimate_memory(hf, layout, train, bf16, False, 4)
        got = estimate_memory(hf, layout, train, bf16, False, 4, muon=True)
        assert plain.optimizer == pytest.approx(n * adam / GIB)
        assert got.optimizer == pytest.approx((vectors * adam + (n - vectors) * muon) / GIB)
        assert got.total < plain.total and got.weights == plain.weights
        # the layer-wise distributed optimizer: every part shared over dp x cp (here dp 2)
        wide = ParallelLayout(4, tp=2, sequence_parallel=True)
        lw = estimate_memory(hf, wide, train, bf16, True, 4, muon=True)
        assert lw.optimizer == pytest.approx((vectors * adam + (n - vectors) * muon) / 2 / GIB)


def test_muon_is_refused_by_name_on_megatron_core_0_17_and_later(monkeypatch):
    """megatron-core >= 0.17 builds Muon through get_megatron_optimizer(optimizer="muon"), which
    the engine does not wire: refused by name instead of silently training AdamW."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "0.19.2" if d == "megatron-core" else real(d))
    problems = optim_problems(OptimConfig(name="muon", distributed_optimizer=False))
    assert any(p.startswith("optim.name=muon is wired to megatron-core 0.16's") and
               "megatron-core 0.19.2" in p for p in problems), problems
    assert optim_problems(OptimConfig()) == []


@needs_package
@pytest.mark.parametrize("bias", [True, False], ids=["critic_value_head", "rm_score_head"])
def test_value_and_score_heads_are_updated_by_adamw_under_muon(pools, bias):
    """optim.name=muon: a PPO critic's value head and a reward model's score head ([1, h], 2-D)
    go to AdamW like the output layer (models.layers.heads.value marks them as megatron marks
    output layers). One step with a tiny gradient (|g| 1e-9..3e-9, below eps 1e-8) moves the
    head by AdamW's amount, lr g / (|g| + eps), a fraction of lr. Negative control: without the
    mark (the engine before the fix) megatron-core puts the head in TensorParallelMuon, which
    moves it by Newton-Schulz's near-fixed length, about lr sqrt(h) along the direction of g,
    whatever the gradient's size."""
    from tests.multirank.muon_heads_check import EPS, HIDDEN, LR

    check = "tests.multirank.muon_heads_check:head_step"
    [fixed] = pools.run(1, check, bias, False)
    assert (fixed["weight"], fixed["embedding"]) == ("AdamW", "AdamW"), fixed
    assert fixed["bias"] == ("AdamW" if bias else None)
    [old] = pools.run(1, check, bias, True)
    assert old["weight"] == "TensorParallelMuon", old
    g = torch.tensor(fixed["grad"])
    adam = -LR * g / (g.abs() + EPS)
    momentum = (1 - MuonConfig().momentum) * g.reshape(1, HIDDEN)   # Muon's first buffer
    muon = -LR * orthogonalized_update(momentum).flatten()
    got, got_old = torch.tensor(fixed["delta"]), torch.tensor(old["delta"])
    torch.testing.assert_close(got, adam, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got_old, muon, rtol=1e-4, atol=1e-7)
    print(f"head update norm: AdamW {got.norm():.3e}, Muon (old) {got_old.norm():.3e}, "
          f"lr sqrt(h) {LR * HIDDEN ** 0.5:.3e}")
    assert got.norm() < 0.25 * LR * HIDDEN ** 0.5 < got_old.norm()


def _without_triton(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that cannot find triton, as where it is not installed:
    every import finder skips it, so find_spec gives None and an import raises Python's own
    ModuleNotFoundError "No module named 'triton'"."""
    prelude = ("import sys\n"
               "class Hide:\n"
               "    def __init__(self, finder):\n"
               "        self.finder = finder\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] != 'triton':\n"
               "            return self.finder.find_spec(name, path, target)\n"
               "    def __getattr__(self, attr):   # find_distributions, invalidate_caches\n"
               "        return getattr(self.finder, attr)\n"
               "sys.meta_path[:] = [Hide(f) for f in sys.meta_path]\n"
               "assert 'triton' not in sys.modules\n")
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, timeout=300)


@needs_package
def test_a_missing_triton_is_named():
    """emerging-optimizers imports triton unconditionally. Without it, megatron-core's own
    import keeps only HAVE_EMERGING_OPTIMIZERS = False (the engine said "could not import
    emerging_optimizers (emerging-optimizers==0.3.0 is installed)"); now the config check
    refuses optim.name=muon naming triton before any process group, and building the
    optimizer anyway raises an ImportError whose `name` and message name it. Here, where
    triton is installed, neither happens."""
    code = ("from engine.config.optim_settings import OptimConfig, optim_problems\n"
            "print('PROBLEMS', optim_problems(OptimConfig(name='muon')))\n"
            "from engine.training import muon\n"
            "try:\n"
            "    muon.muon_module()\n"
            "except ImportError as e:\n"
            "    print('NAME', e.name); print('MESSAGE', e)\n")
    out = _without_triton(code)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("NAME", "MESSAGE", "PROBLEMS"))
    assert lines["PROBLEMS"] == str(["optim.name=muon needs the triton module, which is not "
                                     f"installed: {muon_mod.TRITON_HINT}"]), lines["PROBLEMS"]
    assert lines.get("NAME") == "triton", out.stdout
    assert "No module named 'triton'" in lines["MESSAGE"], lines["MESSAGE"]
    assert "pip install triton" in lines["MESSAGE"], lines["MESSAGE"]
    assert optim_problems(OptimConfig(name="muon")) == []     # here triton is installed
    assert muon_mod.muon_module().HAVE_EMERGING_OPTIMIZERS
