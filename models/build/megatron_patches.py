"""Every change the engine makes to megatron-core's behaviour, in one registry.

`PATCHES` lists each change: its name, the megatron-core targets it changes, the module that
owns its code and where it is applied, the megatron-core versions it was written for and
checked against (a PEP 440 range tested with packaging against `megatron.core.__version__`),
what happens outside that range, why it exists, its probe (models.build.megatron_probes: the
target still looks like what the patch was written against) and the check that it is in effect.
Nothing outside this list may assign into a megatron-core module or class, swap a megatron
object's class or register a module megatron imports (tests/test_megatron_patches.py greps the
tree for such assignments and fails on one that no entry names).

Where each one is applied:
- model-level patches (their code in models/, depending on torch and megatron-core only):
  `install_all()`, called once per model build by models.build.factory.build_model_chunks,
  applies every one of them (idempotent), but the fp32 weight-gradient stand-in, which
  models.build.wgrad_fp32.enable applies (through `gate`) to the chunks megatron DDP wraps;
- engine-level patches stay in their owner modules and are applied where the engine needs
  them, each owner calling `gate(name)` first: models/ never imports engine/, and these belong
  to one optimizer, one kind of save or one optional package, not to every model build (the
  registry holds their range, probe and in-effect check all the same): the grad norm with one
  host sync (engine.training.grad_norm.install, from engine.training.nonfinite when the
  optimizer is built), the checkpoint writer's queue (engine.checkpoint.writer.install, from
  engine.checkpoint.checkpointing at each save), Muon's keyword renames and its fp32
  layer-wise checkpoints (engine.training.muon / engine.training.layer_wise, when a Muon
  optimizer is built);
- model-level patches applied at their own site, gated by `install_all()` at every build
  (CHECKED_AT_BUILD: models/layers cannot import models/build): the MLA module's TE switch
  (models.layers.mla.module, at each HFMultiLatentAttention build) and the compiled layers'
  quiet tensor-parallel lookup (models.build.compile_layers, with train.compile);
- the CPU host runtime (parallel.cpu_runtime, applied by `import models` and
  parallel.cpu_runtime.install() on a host without CUDA): the documented CPU-only layer below
  models/, which cannot consult this registry; listed here, its range and probe checked by the
  tests.

`gate(name)` decides once per process: inside the range, the probe runs; a passing probe
applies the patch. Outside the range, or with a failing probe, an entry whose absence only
costs speed ("skip": megatron's own code runs) is skipped with a warning; an entry whose
absence breaks a run or changes its numbers ("refuse") raises PatchRefused / PatchMismatch
naming the patch, the version and what to do. The ranges cover the releases whose source was
read for each target (0.16.1, 0.17.1, 0.18.2, 0.19.2); the suite runs on 0.16.1 and CI's subset,
tests/test_megatron_patches.py among it, on the newest 0.19.x.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from models.build import megatron_probes as probes
from models.build.megatron_probes import PatchMismatch
from models.layers.attention import packed_rope, rope_tables
from models.layers.experts import compat, sync_free

__all__ = ["PATCHES", "Patch", "PatchMismatch", "PatchRefused", "gate", "install_all",
           "megatron_version", "patch"]

SUPPORTED = ">=0.16.1,<0.20"      # setup.py's megatron-core range
MUON_RANGE = ">=0.16.1,<0.17"     # engine.training.muon refuses >= 0.17 by name
SKIP, REFUSE = "skip", "refuse"


class PatchRefused(RuntimeError):
    """This megatron-core is outside the range a needed patch was written for."""


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]        # the megatron-core names it changes
    owner: str                      # the function that applies it, and from where
    versions: str                   # megatron-core versions it applies to (PEP 440)
    outside: str                    # SKIP or REFUSE: outside the range / on a failing probe
    why: str
    probe: Callable[[], None]       # raises PatchMismatch (models.build.megatron_probes)
    sites: dict[str, tuple[str, ...]]   # file -> the attributes it assigns there
    install: Callable[[], None] | None = None   # set: applied by install_all()
    active: Callable[[], bool] | None = None    # whether it is in effect now

    def applies_to(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.versions)


def _replaced(target: str, module) -> Callable[[], bool]:
    name = module if isinstance(module, str) else module.__name__
    return lambda: probes.replaced_by(target, name)


def _wgrad_active() -> bool:
    layers = probes.resolve(probes.TP_LAYERS)
    return bool(layers._grad_accum_fusion_available) and hasattr(
        layers.fused_weight_gradient_mlp_cuda, "wgrad_gemm_accum_fp32")


def _te_gemm_active() -> bool:
    return hasattr(probes.resolve(probes.MOE_UTILS), "te_general_gemm")


def _writer_active() -> bool:
    return probes.resolve(probes.ASYNC_FS)._results_queue is not None


def _mla_active() -> bool:
    mla = probes.resolve(probes.MLA)
    return mla.HAVE_TE is False and mla.Linear is probes.resolve(
        "megatron.core.post_training.modelopt.layers.Linear")


PATCHES: tuple[Patch, ...] = (
    Patch("rope_bshd_tables", (probes.BSHD,), "models.layers.attention.rope_tables.install",
          SUPPORTED, SKIP, "megatron's unfused RoPE computes cos/sin twice per layer per "
          "micro-batch; the drop-in takes them from one table per angle tensor (bitwise equal).",
          probes.rope_bshd, {"models/layers/attention/rope_tables.py":
                             ("_apply_rotary_pos_emb_bshd",)},
          rope_tables.install, _replaced(probes.BSHD, rope_tables)),
    Patch("rope_thd_gather", (probes.THD,), "models.layers.attention.packed_rope.install",
          SUPPORTED, SKIP, "megatron's packed-row RoPE reads the sequence bounds back to the host "
          "for queries and keys in every layer; the drop-in gathers each token's angles on the "
          "device (the same tensor).", probes.rope_thd,
          {"models/layers/attention/packed_rope.py": ("_apply_rotary_pos_emb_thd",)},
          packed_rope.install, _replaced(probes.THD, packed_rope)),
    Patch("moe_te_general_gemm", (f"{probes.MOE_UTILS}.te_general_gemm",),
          "models.layers.experts.compat.install_te_general_gemm", SUPPORTED, SKIP,
          "megatron-core 0.16 names te_general_gemm only when Transformer Engine imports, so "
          "every router forward without TE raises NameError; defined as None (0.17+ does so).",
          probes.moe_te_general_gemm, {"models/layers/experts/compat.py": ("te_general_gemm",)},
          compat.install_te_general_gemm, _te_gemm_active),
    Patch("moe_expert_bias_padding", (probes.EXPERT_BIAS,),
          "models.layers.experts.compat.install_expert_bias", SUPPORTED, REFUSE,
          "TopKRouter masks padding as routing_map & ~padding_mask ([tokens, experts] against "
          "[tokens]): a shape error, or a wrong expert-bias count; counted per token instead.",
          probes.moe_expert_bias, {"models/layers/experts/compat.py": ("_apply_expert_bias",)},
          compat.install_expert_bias, _replaced(probes.EXPERT_BIAS, compat)),
    Patch("moe_argsort_permute", (probes.PERMUTE,), "models.layers.experts.sync_free."
          "install_permute", ">=0.16.1,<0.17", SKIP, "megatron-core 0.16's permute reads the "
          "routed-pair count back to the host (masked_select) in every MoE layer; a stable "
          "argsort gives the same order without it (0.17+ ships its own).", probes.moe_permute,
          {"models/layers/experts/sync_free.py": ("permute",)}, sync_free.install_permute,
          _replaced(probes.PERMUTE, sync_free)),
    Patch("moe_sync_free_dispatcher", (probes.A2A,), "models.layers.experts.sync_free."
          "install_dispatcher", SUPPORTED, SKIP, "megatron's all-to-all dispatcher copies the "
          "counts per expert to the host and sorts chunks in identity order at tp x ep = 1; the "
          "subclass keeps them on the device (other layouts: megatron's methods).",
          probes.moe_dispatcher, {"models/layers/experts/sync_free.py":
                                  ("MoEAlltoAllTokenDispatcher",)},
          sync_free.install_dispatcher, _replaced(probes.A2A, sync_free)),
    Patch("wgrad_fp32_apex_stand_in", (f"{probes.TP_LAYERS}.fused_weight_gradient_mlp_cuda",
                                       f"{probes.TP_LAYERS}._grad_accum_fusion_available",
                                       "sys.modules['fused_weight_gradient_mlp_cuda']"),
          "models.build.wgrad_fp32.install (from wgrad_fp32.enable, for the chunks megatron "
          "DDP wraps)", SUPPORTED, REFUSE,
          "weight gradients accumulate in fp32 main_grad through megatron's Apex path "
          "(gradient_accumulation_fusion); Apex is not on the package registry, so a torch "
          "stand-in is registered where megatron imports it.", probes.wgrad_fp32,
          {"models/build/wgrad_fp32.py": ("sys.modules", "fused_weight_gradient_mlp_cuda",
                                          "_grad_accum_fusion_available")},
          None, _wgrad_active),
    Patch("quiet_tp_group_default", (f"{probes.TP_LAYERS}.get_tensor_model_parallel_group_if_none",
                                     f"{probes.TP_MAPPINGS}.get_tensor_model_parallel_group_if_none",
                                     f"{probes.TP_LAYERS}.linear_with_grad_accumulation_and_"
                                     "async_allreduce.warned"),
          "models.build.compile_layers.compile_layers (train.compile; gated there)",
          SUPPORTED, SKIP,
          "two warnings megatron issues inside every layer's forward are graph breaks under "
          "torch.compile; the same group lookup without the warning, the advice marked given.",
          probes.quiet_tp_group_default,
          {"models/build/compile_layers.py": ("get_tensor_model_parallel_group_if_none",
                                              "warned")},
          None, _replaced(f"{probes.TP_LAYERS}.get_tensor_model_parallel_group_if_none",
                          "models.build.compile_layers")),
    Patch("grad_norm_one_sync", (f"{probes.CLIP}.l2_norm_impl",
                                 f"{probes.CLIP}.multi_tensor_scale_impl"),
          "engine.training.grad_norm.install (from engine.training.nonfinite)", SUPPORTED, SKIP,
          "without Apex/TE megatron's local grad norm reads every gradient's norm to the host "
          "(hundreds of syncs a step); the same norms stacked on the device, one sync.",
          probes.grad_norm, {"engine/training/grad_norm.py": ("l2_norm_impl",
                                                               "multi_tensor_scale_impl")},
          None, _replaced(f"{probes.CLIP}.l2_norm_impl", "engine.training.grad_norm")),
    Patch("async_writer_queue", (f"{probes.ASYNC_FS}._results_queue",),
          "engine.checkpoint.writer.install (from engine.checkpoint.checkpointing, each save)",
          SUPPORTED, SKIP, "megatron's async writer's Manager server outlives a SIGKILLed rank "
          "and holds the job's output open; ours dies with its rank and ignores SIGTERM/SIGINT.",
          probes.async_writer_queue, {"engine/checkpoint/writer.py": ("_results_queue",)},
          None, _writer_active),
    Patch("layer_wise_fp32_checkpoints", (f"{probes.LAYER_WISE}.sharded_state_dict",),
          "engine.training.layer_wise.with_fp32_checkpoints (from engine.training.optimizers)",
          MUON_RANGE, REFUSE, "megatron's layer-wise optimizer post-processes every chained "
          "optimizer's state as mixed-precision (KeyError 'optimizer' with fp32 ones); an "
          "instance __class__ swap presents the fp32 layout under that key.",
          probes.layer_wise_fp32, {"engine/training/layer_wise.py": ("__class__",)}),
    Patch("muon_keyword_renames", (f"{probes.MUON}.TensorParallelMuon",
                                   f"{probes.MUON}.newton_schulz_tp"),
          "engine.training.muon.muon_module", MUON_RANGE, REFUSE,
          "megatron-core 0.16.1's TensorParallelMuon passes use_nesterov= and mode=, which "
          "emerging-optimizers 0.3.0 names nesterov and tp_mode; renamed, no value changes "
          "(megatron's module re-imported once after the typing shim).", probes.muon_keywords,
          {"engine/training/muon.py": ("sys.modules", "TensorParallelMuon", "newton_schulz_tp")}),
    Patch("mla_no_te_linear", (f"{probes.MLA}.HAVE_TE", f"{probes.MLA}.Linear"),
          "models.layers.mla.module.HFMultiLatentAttention (each build)", SUPPORTED, REFUSE,
          "megatron 0.16 sets HAVE_TE when its TE extension module imports even with stand-in "
          "linears, and its MLA then tests isinstance(linear_proj, TELinear); the local spec has "
          "no TE linears.", probes.mla_no_te,
          {"models/layers/mla/module.py": ("HAVE_TE", "Linear")}, None, _mla_active),
    Patch("cpu_host_runtime", (f"{probes.RANDOM}._get_cuda_rng_state",
                               f"{probes.RANDOM}._set_cuda_rng_state",
                               "megatron.core.jit.jit_fuser"),
          "parallel.cpu_runtime.install / skip_megatron_jit_on_cpu (CPU hosts only)", SUPPORTED,
          REFUSE, "the CPU-only layer: megatron's CUDA RNG tracker and jit fuser made to run on a "
          "host without CUDA (the CPU suite and demos).", probes.cpu_runtime,
          {"parallel/cpu_runtime.py": ("_get_cuda_rng_state", "_set_cuda_rng_state")},
          None, _replaced(f"{probes.RANDOM}._get_cuda_rng_state", "parallel.cpu_runtime")),
)

_BY_NAME = {p.name: p for p in PATCHES}
# model-level, applied at their own site (models/layers cannot import models/build; the compiled
# layers' module applies its own), gated by install_all at every build
CHECKED_AT_BUILD = ("quiet_tp_group_default", "mla_no_te_linear")
_DECIDED: dict[str, bool] = {}


def patch(name: str) -> Patch:
    """The registry entry `name`; KeyError names the valid ones."""
    if name not in _BY_NAME:
        raise KeyError(f"no megatron-core patch {name!r}; registered: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def megatron_version() -> str:
    return importlib.import_module("megatron.core").__version__


def decide(entry: Patch, version: str) -> bool:
    """Whether `entry` applies under megatron-core `version` (module docstring): True, False
    (skipped, with a warning) or PatchRefused / PatchMismatch."""
    if not entry.applies_to(version):
        where = (f"megatron patch {entry.name!r} ({entry.owner}) was written and tested for "
                 f"megatron-core {entry.versions}, not {version}")
        if entry.outside == REFUSE:
            raise PatchRefused(f"{where}; it is needed ({entry.why}): use megatron-core "
                               f"{SUPPORTED}")
        if entry.versions == SUPPORTED:   # a range narrower than the project's is by design
            warnings.warn(f"{where}: skipped, megatron's own code runs", stacklevel=3)
        return False
    try:
        entry.probe()
    except PatchMismatch as e:
        if entry.outside == REFUSE:
            raise PatchMismatch(f"megatron patch {entry.name!r} ({entry.owner}) does not match "
                                f"megatron-core {version}: {e}") from e
        warnings.warn(f"megatron patch {entry.name!r} skipped: {e}", stacklevel=3)
        return False
    return True


def gate(name: str) -> bool:
    """Whether patch `name` applies in this process (decided once; see `decide`)."""
    if name not in _DECIDED:
        _DECIDED[name] = decide(patch(name), megatron_version())
    return _DECIDED[name]


def install_all() -> list[str]:
    """Apply every model-level patch (entries with `install`) that `gate` lets through, in
    registry order (idempotent), and gate the model-level ones applied at their own site
    (CHECKED_AT_BUILD: a refused one stops the build here); returns the names applied."""
    applied = []
    for entry in PATCHES:
        if entry.install is not None and gate(entry.name):
            entry.install()
            applied.append(entry.name)
        elif entry.name in CHECKED_AT_BUILD:
            gate(entry.name)
    return applied
