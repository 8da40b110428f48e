"""Run-time failures that end a run with a clear message instead of a traceback.

`RunError` subclasses are raised identically on every rank (the decision is taken from
globally reduced values, or broadcast from rank 0); engine.run.launch.run_entry prints the
message once (rank 0) and exits with code 1. Configuration and data errors are separate (exit 2)."""
from __future__ import annotations


class RunError(RuntimeError):
    """A failure of a running job whose message says what happened and what to do."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the constraint and valid values."""
