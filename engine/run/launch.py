"""A training entry point's run, once engine.cli parsed its command line: validation, the
process groups, megatron's parallel state, the header lines and the run itself.

`run_entry(run, argv, schema, validate, split)`: load `schema` from argv, validate (default
validate_common), start torch.distributed and megatron state for the configured layout, print
the layout, kernels and run header lines (rank 0; the header: engine.run.header), then import
`run` ("package.module:function") and call it as run(cfg, hf_config, flags); its errors become
exit codes (engine.cli's module docstring).
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

from engine.checkpoint.schedule import ResumeMismatchError
from engine.cli import fail, refuse
from engine.config.schema import (ConfigError, SFTConfig, load_config, parallel_layout,
                                  validate_common)
from engine.data.files import DataError
from engine.errors import RunError
from engine.run.header import Host, run_header
from models.bridge.errors import CheckpointError
from models.layers.attention.varlen import flash_capable
from models.layers.spec import transformer_engine_available
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown


def kernel_notice() -> str:
    """What runs the layers, said once per launch (megatron's own import-time warnings about
    Transformer Engine and Apex are filtered in parallel/__init__.py)."""
    if transformer_engine_available():
        return "Transformer Engine (fused attention, norms and linears)"
    return ("Transformer Engine not installed: torch layers (SDPA attention, torch norms) "
            "and megatron's unfused fallbacks; exact, slower on GPUs")


def this_host() -> Host:
    """What this process runs on, for the run header (engine.run.header)."""
    cuda = torch.cuda.is_available()
    return Host(cuda=cuda, flash=cuda and flash_capable(torch.cuda.current_device()),
                te=transformer_engine_available())


def run_entry(run: str, argv: list[str], schema=None,
              validate: Callable | None = None, split: Callable | None = None) -> int:
    """Load `schema` (default SFTConfig) from argv, validate (default validate_common), start
    distributed + megatron state for the configured layout, then import `run`
    ("package.module:function") and call it as run(cfg, hf_config, flags).
    `split(cfg)`: None (one world), or it starts a split job's process groups itself and
    returns (role, other_run): role "train" continues as above over the training world
    (os.environ WORLD_SIZE is then the training world's); role "rollout" calls `other_run`
    as other_run(cfg, hf_config, flags) without megatron state."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg, flags = load_config(schema or SFTConfig, argv)
        hf_config = (validate or validate_common)(cfg, world)
    except ConfigError as e:
        return refuse(str(e))
    side = split(cfg) if split is not None else None
    if side is None:
        init_distributed()
    elif side[0] == "rollout":
        rc = _call(side[1], cfg, hf_config, flags)
        shutdown(barrier=rc == 0)
        return rc
    layout = parallel_layout(cfg.parallel, int(os.environ["WORLD_SIZE"]))
    setup_model_parallel(layout, seed=cfg.seed)
    if int(os.environ.get("RANK", "0")) == 0:
        tag = run.split(".")[1]   # "engine.<entry point>.module:function"
        print(f"[{tag}] layout: {layout.describe()}", flush=True)
        print(f"[{tag}] kernels: {kernel_notice()}", flush=True)
        print(f"[{tag}] runs: {run_header(cfg, this_host())}", flush=True)
    rc = _call(run, cfg, hf_config, flags)
    shutdown(barrier=rc == 0)
    return rc


def _call(run: str, cfg, hf_config: dict, flags: list[str]) -> int:
    """Import `run` ("package.module:function"), call it, map its errors to exit codes."""
    # the run module is imported only now (it builds models; a config error above exits first)
    module_name, function = run.split(":")
    run_fn = getattr(importlib.import_module(module_name), function)
    try:
        return run_fn(cfg, hf_config, flags)
    except (CheckpointError, ResumeMismatchError) as e:
        return fail(f"checkpoint: {e}")
    except DataError as e:
        return fail(f"data: {e}")
    except RunError as e:
        return fail(str(e), code=1)
