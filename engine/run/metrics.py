"""Metrics output: a JSON-lines file, TensorBoard scalars, the experiment trackers and a tqdm
progress bar.

Only one rank writes (the caller passes enabled = rank 0). The values handed in must already be
reduced across ranks (see engine loss/metrics reduction); this module never communicates.
Every step written to metrics.jsonl is also handed, as written, to the experiment trackers
the run loop started (engine.run.trackers.active: W&B, MLflow), when there are any.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Mapping

from tqdm.auto import tqdm

from engine.run.trackers import active

__all__ = ["MetricsLogger", "progress_bar", "format_postfix", "POSTFIX_KEYS"]

# Progress-bar field -> metric names looked for, in order (a name also matches "<prefix>/name").
POSTFIX_KEYS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "policy_loss"),
    "lr": ("lr", "learning_rate"),
    "tok/s": ("tokens_per_s", "tokens_per_sec", "throughput"),
}


def _to_float(name: str, value: Any) -> float:
    """A Python float from a number, 0-d numpy array or one-element torch tensor."""
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {name!r} must be a real number, got {type(value).__name__}")
    return float(value)


class MetricsLogger:
    """Appends one JSON object per `log` call to ``log_dir/metrics.jsonl`` and writes the same
    scalars to TensorBoard event files in ``log_dir`` and to the active experiment trackers.

    JSON lines: ``{"step": int, "<name>": float, ...}``, flushed per line; NaN/inf are written as
    Python's json writes them (NaN, Infinity), so a diverged run stays visible. When `enabled`
    is False (non-zero ranks) or `log_dir` is None, nothing is written and no file is created.
    The file is opened in append mode, so a resumed run continues it.
    """

    def __init__(self, log_dir: str | None, enabled: bool):
        self.log_dir = log_dir
        self.enabled = bool(enabled) and log_dir is not None
        self._file = None
        self._writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # only with tensorboard on

            os.makedirs(log_dir, exist_ok=True)
            self._file = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")
            self._writer = SummaryWriter(log_dir=log_dir)

    @property
    def jsonl_path(self) -> str | None:
        """Path of the JSON-lines file, or None when this logger writes nothing."""
        return os.path.join(self.log_dir, "metrics.jsonl") if self.enabled else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number) for optimizer step `step`."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        values = {name: _to_float(name, v) for name, v in metrics.items()}
        self._file.write(json.dumps({"step": int(step), **values}) + "\n")
        self._file.flush()
        for name, v in values.items():
            self._writer.add_scalar(name, v, global_step=int(step))
        self._writer.flush()
        trackers = active()
        if trackers is not None:
            trackers.log(int(step), values)

    def close(self) -> None:
        """Flush and close the files; further log calls raise (on the writing rank)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int, enabled: bool, desc: str, initial: int = 0):
    """A tqdm bar over `total` steps starting at `initial` (resume); silent when not enabled."""

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True)


def _one_file_not_a_terminal(a, b) -> bool:
    """Whether streams `a` and `b` write to the same file or pipe, which is not a terminal
    (`2>&1` into a log, SLURM's one output file)."""
    try:
        fa, fb = a.fileno(), b.fileno()
        sa, sb = os.fstat(fa), os.fstat(fb)
        return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino) and not os.isatty(fa)
    except (AttributeError, OSError, ValueError):   # no file descriptor (a test's buffer)
        return False


class LinesAboveBar:
    """A stdout for the time a progress bar is drawn: every complete line printed is written
    above the bar (bar cleared, line written and flushed, bar redrawn) instead of on the bar's
    own line. Where the bar and the lines share one file that is not a terminal (stderr merged
    into stdout), a carriage return cannot clear the bar: the bar's line is ended first, so
    every printed line starts a line of that file (`grep '^\\[compile\\]'` finds it). Use with
    contextlib.redirect_stdout; a disabled bar changes nothing."""

    def __init__(self, bar, out) -> None:
        self.bar, self.out, self.pending = bar, out, ""
        self.merged = not bar.disable and _one_file_not_a_terminal(out, getattr(bar, "fp", None))

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            if self.merged:
                lines = "\n" + lines          # ends the bar's line
            elif not self.bar.disable:
                self.bar.clear()
            self.out.write(lines + "\n")
            self.out.flush()
            if not self.bar.disable:
                self.bar.refresh()
        return len(text)

    def flush(self) -> None:
        if self.pending:   # a line without its end yet: written as it is
            self.write("\n")
        self.out.flush()


def _find(metrics: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in metrics:
            return metrics[name]
    for name in names:
        for key, value in metrics.items():
            if key.endswith("/" + name):
                return value
    return None


def format_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The bar's postfix: loss (4 significant digits), lr (2 decimals, exponent) and tokens/s
    (integer) when present, found by the names in POSTFIX_KEYS; absent ones are left out."""
    out: dict[str, str] = {}
    formats = {"loss": "{:.4g}", "lr": "{:.2e}", "tok/s": "{:.0f}"}
    for field, names in POSTFIX_KEYS.items():
        value = _find(metrics, names)
        if value is None:
            continue
        v = _to_float(field, value)
        out[field] = formats[field].format(v) if math.isfinite(v) else str(v)
    return out
