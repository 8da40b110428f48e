"""The registry of the engine's changes to megatron-core (models.build.megatron_patches): per
patch, its probe passes against the installed megatron-core and the patch is in effect after
its install (or, outside its megatron-core range, it is refused or skipped as the entry says);
probes fed a changed target fail (negative controls); and a static scan of engine/, models/,
parallel/ and tools/ finds no assignment into megatron-core outside the registry's sites (and
every site the registry names is still there). Runs in the 0.19.x subset of .ci/run too."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.transformer import multi_latent_attention as megatron_mla

from engine.checkpoint import writer
from engine.training import grad_norm, layer_wise
from engine.training import muon as muon_mod
from models.build import megatron_patches as mp
from models.build import megatron_probes as probes
from models.build import wgrad_fp32
from models.build.compile_layers import compile_layers
from models.layers.experts import sync_free
from models.layers.mla.module import HFMultiLatentAttention
from parallel import cpu_runtime

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "models", "parallel", "tools")
VERSION = mp.megatron_version()


def _build_mla_until_megatron() -> None:
    """HFMultiLatentAttention's constructor up to megatron's own (which needs process groups):
    the site where the MLA patch is applied, after TE's import state is restored."""
    megatron_mla.HAVE_TE, megatron_mla.Linear = True, None
    config = types.SimpleNamespace(rope_type="yarn")
    with pytest.raises(Exception):
        HFMultiLatentAttention(config, None, 1, inv_freq=torch.ones(2), attention_factor=1.0,
                               softmax_scale=1.0)
    assert config.rope_type == "yarn"


def _muon() -> None:
    if not (muon_mod.emerging_optimizers_installed() and muon_mod.triton_problem() is None):
        pytest.skip("optim.name=muon needs emerging-optimizers and triton")
    muon_mod.muon_module()


def _cpu_runtime() -> str:
    """The CPU host runtime installed in a fresh interpreter (it changes torch.cuda and enters a
    device mode for the whole process: not in this test worker); its `active()` there."""
    code = ("from parallel import cpu_runtime; cpu_runtime.install()\n"
            "from models.build import megatron_patches as mp\n"
            "print('ACTIVE', mp.patch('cpu_host_runtime').active())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _layer_wise() -> object:
    optimizer = object.__new__(LayerWiseDistributedOptimizer)   # the class swap needs no state
    return layer_wise.with_fp32_checkpoints(optimizer)


# how each patch is applied where the engine applies it (its owner's call)
APPLY = {
    "quiet_tp_group_default": lambda: compile_layers([]),
    "wgrad_fp32_apex_stand_in": wgrad_fp32.install,
    "grad_norm_one_sync": grad_norm.install,
    "async_writer_queue": writer.install,
    "layer_wise_fp32_checkpoints": _layer_wise,
    "muon_keyword_renames": _muon,
    "mla_no_te_linear": _build_mla_until_megatron,
    "cpu_host_runtime": _cpu_runtime,
}


def _in_effect(name: str, applied) -> bool:
    if name == "layer_wise_fp32_checkpoints":
        return type(applied) is layer_wise.LayerWiseOptimizer
    if name == "muon_keyword_renames":
        module = muon_mod.muon_module()
        renamed = module.TensorParallelMuon.__module__ == muon_mod.__name__
        needed = "nesterov" in inspect.signature(module.OrthogonalizedOptimizer.__init__).parameters
        return renamed == needed    # emerging-optimizers 0.3.0 names it nesterov
    if name == "cpu_host_runtime":
        return "ACTIVE True" in applied
    if name == "async_writer_queue":
        return mp.patch(name).active() and writer._manager._process.is_alive()
    return mp.patch(name).active()


# left applied after a test: the Muon module's renames (muon_module is cached; test_muon uses
# them), the writer's queue (its server lives with the process); the CPU runtime runs elsewhere
KEPT = ("muon_keyword_renames", "async_writer_queue", "layer_wise_fp32_checkpoints",
        "cpu_host_runtime")
MISSING = object()


def _loaded(dotted: str):
    """The object at `dotted` through modules already imported (none imported here), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:cut]))
        if obj is not None:
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            return obj
    return None


@pytest.fixture(autouse=True)
def megatron_as_found():
    """Undo each test's installs: later test files on this worker see megatron-core as this one
    found it (tests/test_rope_tables.py counts table computations through megatron's own thd
    RoPE, which calls the bshd one)."""
    saved = [(sys.modules, "fused_weight_gradient_mlp_cuda",
              sys.modules.get("fused_weight_gradient_mlp_cuda", MISSING))]
    for entry in mp.PATCHES:
        for target in entry.targets if entry.name not in KEPT else ():
            owner_name, attr = target.rsplit(".", 1)
            owner = _loaded(owner_name)
            if owner is not None and not target.startswith("sys.modules"):
                saved.append((owner, attr, vars(owner).get(attr, MISSING)))
    yield
    for owner, attr, value in reversed(saved):
        if owner is sys.modules:
            if value is MISSING:
                sys.modules.pop(attr, None)
            else:
                sys.modules[attr] = value
        elif value is MISSING:
            if attr in vars(owner):
                delattr(owner, attr)
        else:
            setattr(owner, attr, value)


def test_every_entry_is_complete():
    names = [p.name for p in mp.PATCHES]
    assert len(names) == len(set(names)) == 14
    for p in mp.PATCHES:
        assert p.outside in (mp.SKIP, mp.REFUSE), p.name
        assert Version("0.16.1") in SpecifierSet(p.versions), p.name
        assert p.targets and all(t.startswith(("megatron.core.", "sys.modules[")) for t in p.targets)
        assert 20 < len(p.why) < 400 and p.owner.split(".")[0] in ("models", "engine", "parallel")
        assert all((ROOT / f).is_file() for f in p.sites), p.sites
        assert (p.install is None) == (p.name in APPLY), p.name
    with pytest.raises(KeyError, match="registered"):
        mp.patch("no_such_patch")


@pytest.mark.parametrize("name", [p.name for p in mp.PATCHES])
def test_patch_probe_and_effect(name):
    """In range: the probe passes and, once applied (install_all, or its owner's call), the
    patch is in effect. Outside: refused by name, or skipped (megatron's own code runs)."""
    entry = mp.patch(name)
    if not entry.applies_to(VERSION):
        if entry.outside == mp.REFUSE:
            with pytest.raises(mp.PatchRefused, match=name):
                mp.decide(entry, VERSION)
        else:
            assert mp.decide(entry, VERSION) is False
            assert name not in mp.install_all()
        return
    if name == "cpu_host_runtime" and cpu_runtime.cuda_available():
        pytest.skip("the CPU host runtime applies on a host without CUDA only")
    entry.probe()
    assert mp.gate(name) is True
    applied = APPLY[name]() if name in APPLY else None
    if name not in APPLY:
        assert name in mp.install_all()
    assert _in_effect(name, applied), f"{name} is not in effect after its install"


def test_the_installed_fixes_compute_the_intended_numbers():
    """Beyond `active()` (which checks where the object now at the target comes from): through
    megatron's own names after install_all, the expert-bias count leaves padding out; the
    grad-norm drop-in gives the [1] norm megatron's local stand-in computes."""
    routing = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    padding = torch.tensor([False, True, False])
    with torch.enable_grad():
        mp.install_all()
        megatron_router = probes.resolve("megatron.core.transformer.moe.router.TopKRouter")
        megatron_router._apply_expert_bias(router, routing, padding)
    assert router.local_tokens_per_expert.tolist() == [2.0, 1.0, 1.0]   # row 1 is padding
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    norm, _ = grad_norm.l2_norm(2048, None, [grads], False)
    assert norm.tolist() == [5.0]


# ---- negative controls: a megatron-core change under a patch is caught ----

def _fake_get(replace: dict):
    return lambda dotted: replace[dotted] if dotted in replace else probes.original(dotted)


def _renamed_bshd(t, freq, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    return t


def _shifted_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False,
                  mscale=1.0):
    return probes.original(probes.BSHD)(t, freqs, rotary_interleaved, False, mscale) + 1e-6


def _uncounting_bias(self, routing_map, padding_mask=None):
    pass


@pytest.mark.parametrize("probe,replace,message", [
    (probes.rope_bshd, {probes.BSHD: _renamed_bshd}, "parameters"),
    (probes.rope_bshd, {probes.BSHD: _shifted_bshd}, "bitwise"),
    (probes.moe_expert_bias, {probes.EXPERT_BIAS: _uncounting_bias}, "routed tokens"),
    (probes.grad_norm, {"megatron.core.utils.local_multi_tensor_scale":
                        lambda chunk_size, noop_flag, tensor_lists, factor: None}, "parameters"),
])
def test_a_probe_fails_on_a_changed_target(probe, replace, message):
    probe()                                       # the real target passes (in range)
    with pytest.raises(probes.PatchMismatch, match=message):
        probe(_fake_get(replace))


def test_static_probes_fail_on_changed_source():
    """Muon's and the CPU runtime's probes read megatron's source: renamed keywords and a
    renamed RNG function are caught."""
    fake = ast.parse("class TensorParallelMuon:\n    def __init__(self, nesterov=True):\n"
                     "        super().__init__(nesterov=nesterov)\n"
                     "def _get_cuda_rng_state(dev): pass\n"
                     "def _set_cuda_rng_state(new_state): pass\n")
    defs = {"TensorParallelMuon.__init__": fake.body[0].body[0],
            "_get_cuda_rng_state": fake.body[1], "_set_cuda_rng_state": fake.body[2]}
    with pytest.raises(probes.PatchMismatch, match="use_nesterov"):
        probes.muon_keywords(lambda module: defs)
    with pytest.raises(probes.PatchMismatch, match="_get_cuda_rng_state"):
        probes.cpu_runtime(lambda module: defs)


def test_gate_refuses_or_skips_outside_the_range_and_on_a_failing_probe():
    refuse, skip = mp.patch("moe_expert_bias_padding"), mp.patch("rope_bshd_tables")
    with pytest.raises(mp.PatchRefused, match="moe_expert_bias_padding.*0.20.0"):
        mp.decide(refuse, "0.20.0")
    with pytest.warns(UserWarning, match="rope_bshd_tables"):
        assert mp.decide(skip, "0.20.0") is False

    def broken():
        raise probes.PatchMismatch("renamed")
    with pytest.raises(probes.PatchMismatch, match="moe_expert_bias_padding.*renamed"):
        mp.decide(dataclasses.replace(refuse, probe=broken), VERSION)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert mp.decide(dataclasses.replace(skip, probe=broken), VERSION) is False
    assert any("renamed" in str(w.message) for w in seen)


# ---- every assignment into megatron-core is a registry site ----

def megatron_writes(source: str) -> set[str]:
    """Attributes assigned (or setattr / del-ed) on names bound to megatron-core in `source`
    (imports, loop variables over them, parameters a megatron name is passed to), plus any
    `sys.modules[...]` write and `__class__` swap."""
    tree = ast.parse(source)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.startswith("megatron")}
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)) and \
                any(isinstance(e, ast.Name) and e.id in bound for e in node.iter.elts):
            bound.add(ast.unparse(node.target))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in defs:
            args = defs[node.func.id].args.args
            bound |= {args[i].arg for i, a in enumerate(node.args[:len(args)])
                      if isinstance(a, ast.Name) and a.id in bound}

    def base(expr) -> str:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return getattr(expr, "id", "")

    found: set[str] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") \
                and base(node.args[0]) in bound:
            found.add(ast.literal_eval(node.args[1]) if isinstance(node.args[1], ast.Constant)
                      else "setattr")
        for target in targets:
            if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
                found.add("sys.modules")
            elif isinstance(target, ast.Attribute) and (target.attr == "__class__"
                                                        or base(target) in bound):
                found.add(target.attr)
    return found


def _tree_writes() -> set[tuple[str, str]]:
    found = set()
    for root in SCANNED:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            found |= {(rel, attr) for attr in megatron_writes(path.read_text())}
    return found


# writes the scan sees that never reach megatron-core: the code reward's runner is a script run by
# a separate interpreter inside the bubblewrap sandbox (engine.rl.rewards.sandbox), with the
# standard library only; its sys.modules writes install the untrusted solution as a module
OUTSIDE_MEGATRON = {("engine/rl/rewards/code_runner.py", "sys.modules")}


def test_every_assignment_into_megatron_is_a_registry_site():
    declared = {(f, a) for p in mp.PATCHES for f, attrs in p.sites.items() for a in attrs}
    found = _tree_writes() - OUTSIDE_MEGATRON
    assert found - declared == set(), "assignments into megatron-core outside the registry " \
                                      "(models.build.megatron_patches): add an entry"
    assert declared - found == set(), "registry sites no longer in the tree: update the entry"


def test_the_scan_catches_a_new_assignment():
    """Negative control: an unregistered write into a megatron module, through an import, a
    loop, a parameter or setattr, and a class swap."""
    source = ("from megatron.core import utils, parallel_state as ps\n"
              "import megatron.core.jit\n"
              "def f(mod):\n    mod.helper = None\n"
              "f(utils)\n"
              "for m in (utils, ps):\n    m.is_initialized = lambda: True\n"
              "megatron.core.jit.jit_fuser = None\n"
              "setattr(ps, 'world', 2)\n"
              "obj = object()\nobj.__class__ = int\n"
              "unrelated = types.SimpleNamespace(); unrelated.x = 1\n")
    assert megatron_writes(source) == {"helper", "is_initialized", "jit_fuser", "world",
                                       "__class__"}


@pytest.mark.parametrize("flip", [False, True])
def test_sync_free_dispatch_starts_shared_experts_once(flip, monkeypatch):
    """megatron-core >= 0.18 starts the shared experts' fc1 in token_dispatch, 0.16-0.17 in
    dispatch_postprocess: with the local path's own call, one dispatch starts it exactly once.
    `flip` (negative control): the other choice starts it twice or never."""
    if flip:
        monkeypatch.setattr(sync_free, "SHARED_FC1_IN_POSTPROCESS",
                            not sync_free.SHARED_FC1_IN_POSTPROCESS)
    calls = []
    shared = types.SimpleNamespace(linear_fc1_forward_and_act=calls.append)
    dispatcher = types.SimpleNamespace(local_only=True, shared_experts=shared,
                                       tokens_per_expert=torch.tensor([2, 1]))
    tokens, probs = torch.ones(3, 4), torch.ones(3)
    out = sync_free.SyncFreeAlltoAllDispatcher.dispatch_postprocess(dispatcher, tokens, probs)
    assert out[1].tolist() == [2, 1] and dispatcher.tokens_per_expert is None
    megatron = probes.original(probes.A2A)
    in_dispatch = "linear_fc1_forward_and_act" in inspect.getsource(megatron.token_dispatch)
    assert (in_dispatch + len(calls) == 1) != flip
