"""Shared entry-point plumbing: parse and validate the config before any process group
exists, report configuration errors once (rank 0) without a traceback and exit 2, then set up
torch.distributed and megatron's parallel state and run. Exit codes: 0 done (also when
stopped by a signal or train.exit_*), 2 configuration or data error, 1 run-time failure
(engine.errors.RunError: diverged training, failed rollout backend)."""
from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
import time
from typing import Callable, NoReturn

from engine.config.help import help_text, version
from engine.config.schema import (ConfigError, SFTConfig, load_config, parallel_layout,
                           validate_common)
from engine.data.files import DataError
from engine.errors import RunError
from models.layers.spec import transformer_engine_available
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def exit_process(code: int) -> NoReturn:
    """End the process with exit status `code` as a normal exit would (non-daemon threads
    joined, atexit handlers run, stdout/stderr flushed), minus the interpreter's teardown of
    every module, which takes about 1 s of CPU with torch, megatron and transformers loaded
    (per rank, at the end of every launch). For `__main__` blocks only: files the run wrote
    must be closed by then (the engines close theirs before returning). As at a normal exit,
    threading's exit callbacks run before the joins: concurrent.futures' one stops the idle
    workers of its thread pools (torch.compile's compile pool), which a join would wait on
    forever."""
    for callback in reversed(getattr(threading, "_threading_atexits", [])):
        callback()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def answered_help(argv: list[str], prog: str, schema, usage: str,
                  examples: list[str]) -> bool:
    """-h / --help: print the schema's keys (engine.config.help); --version: the version.
    True when one of them was answered (the caller exits 0)."""
    if "-h" in argv or "--help" in argv:
        if _rank() == 0:
            print(help_text(prog, schema, usage, examples), end="", flush=True)
        return True
    if "--version" in argv:
        if _rank() == 0:
            print(f"{prog} {version()}", flush=True)
        return True
    return False


def entry_main(argv: list[str] | None, prog: str, schema, usage: str, examples: list[str],
               check_recipe: Callable[[list[str]], int], run: str, **run_kwargs) -> int:
    """The main function of every training entry point (`python -m engine.sft` and its
    siblings): -h / --help / --version answered from `schema` (`answered_help`); --validate:
    the recipe check `check_recipe(argv)` (no process groups, no weights, no training); else
    `run_entry(run, argv, schema=schema, **run_kwargs)`. `argv`: None reads sys.argv[1:]."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if answered_help(argv, prog, schema, usage, examples):
        return 0
    if "--validate" in argv:
        return check_recipe(argv)
    return run_entry(run, argv, schema=schema, **run_kwargs)


def kernel_notice() -> str:
    """What runs the layers, said once per launch (megatron's own import-time warnings about
    Transformer Engine and Apex are filtered in parallel/__init__.py)."""
    if transformer_engine_available():
        return "Transformer Engine (fused attention, norms and linears)"
    return ("Transformer Engine not installed: torch layers (SDPA attention, torch norms), "
            "torch Adam and megatron's unfused fallbacks; exact, slower on GPUs")


def fail(message: str, code: int = 2) -> int:
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code


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
        if _rank() != 0:  # let rank 0 print before torchrun stops the job on the first exit
            time.sleep(3)
        return fail(str(e))
    side = split(cfg) if split is not None else None
    if side is None:
        init_distributed()
    elif side[0] == "rollout":
        rc = _call(side[1], cfg, hf_config, flags)
        shutdown(barrier=rc == 0)
        return rc
    layout = parallel_layout(cfg.parallel, int(os.environ["WORLD_SIZE"]))
    setup_model_parallel(layout, seed=cfg.seed)
    if _rank() == 0:
        tag = run.split(".")[1]   # "engine.<entry point>.module:function"
        print(f"[{tag}] layout: {layout.describe()}", flush=True)
        print(f"[{tag}] kernels: {kernel_notice()}", flush=True)
    rc = _call(run, cfg, hf_config, flags)
    shutdown(barrier=rc == 0)
    return rc


def _call(run: str, cfg, hf_config: dict, flags: list[str]) -> int:
    """Import `run` ("package.module:function"), call it, map its errors to exit codes."""
    # the run module is imported only now (it builds models; a config error above exits first)
    module_name, function = run.split(":")
    run_fn = getattr(importlib.import_module(module_name), function)
    # megatron's dist_checkpointing loads only once a run starts (config errors exit first)
    from engine.checkpoint.checkpointing import CheckpointError, ResumeMismatchError
    try:
        return run_fn(cfg, hf_config, flags)
    except (CheckpointError, ResumeMismatchError) as e:
        return fail(f"checkpoint: {e}")
    except DataError as e:
        return fail(f"data: {e}")
    except RunError as e:
        return fail(str(e), code=1)
