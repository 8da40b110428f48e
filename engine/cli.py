"""Shared entry-point plumbing: parse the command line first, import what the command needs
after. -h / --help, --version and every configuration hydra refuses (an unknown key, a wrong
type, a missing --config file) or engine.config.choices refuses (a value that is none of its
key's choices) are answered from the schema as engine.config.schema_source reads it from
source, before torch, megatron-core or transformers is imported (well under 2 s). Only then
are the entry point's modules imported and engine.run.launch.run_entry validates the values,
reports configuration errors once (rank 0) without a traceback and exits 2, sets up
torch.distributed and megatron's parallel state and runs. Exit codes: 0 done (also when
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

from engine.config.choices import choice_error
from engine.config.help import help_text, version
from engine.config.loading import load_config
from engine.config.schema_source import SchemaSourceError, real_schema, source_schema
from engine.errors import ConfigError


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


def hook(ref: str) -> Callable:
    """The function `ref` ("package.module:function"), imported at its first call: an entry
    point names its validation, recipe check and split this way, so that nothing of them loads
    before its command line parsed."""
    def call(*args, **kwargs):
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    call.__qualname__ = call.__name__ = ref
    return call


def parsed_schema(ref: str) -> type:
    """The schema `ref` ("package.module:Class") as --help and the first parse read it: rebuilt
    from source (no heavy import), or, for a construct the reader does not evaluate, imported."""
    try:
        return source_schema(ref)
    except SchemaSourceError:
        return real_schema(ref)


def entry_main(argv: list[str] | None, prog: str, schema: str, usage: str, examples: list[str],
               check_recipe: Callable[[list[str]], int], run: str, **run_kwargs) -> int:
    """The main function of every training entry point (`python -m engine.sft` and its
    siblings). `schema`: "package.module:Class". -h / --help / --version answered from the
    schema's source (`answered_help`); --validate: the recipe check `check_recipe(argv)` (no
    process groups, no weights, no training); else the command line is composed against the
    schema's source and its choice keys checked (engine.config.choices; a refusal exits 2
    here, nothing heavy imported), then
    engine.run.launch.run_entry(run, argv, schema=the imported schema, **run_kwargs).
    `argv`: None reads sys.argv[1:]."""
    argv = list(argv if argv is not None else sys.argv[1:])
    light = parsed_schema(schema)
    if answered_help(argv, prog, light, usage, examples):
        return 0
    if "--validate" in argv:
        return check_recipe(argv)
    try:
        composed, _ = load_config(light, argv)
    except ConfigError as e:
        return refuse(str(e))
    bad_choice = choice_error(composed)   # before the heavy imports (engine.config.choices)
    if bad_choice:
        return refuse(bad_choice)
    return hook("engine.run.launch:run_entry")(run, argv, schema=real_schema(schema),
                                                **run_kwargs)


def refuse(message: str) -> int:
    """A configuration error: exit code 2, the message printed by rank 0 only (the other ranks
    wait 3 s first, so rank 0 prints before torchrun stops the job on the first exit)."""
    if _rank() != 0:
        time.sleep(3)
    return fail(message)


def fail(message: str, code: int = 2) -> int:
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code
