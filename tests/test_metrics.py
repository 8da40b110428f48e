"""Metrics output: metrics.jsonl content, TensorBoard scalars read back, disabled ranks write
nothing, progress-bar postfix."""
from __future__ import annotations

import glob
import json
import math
import os

import numpy as np
import pytest
import torch

from engine.run.metrics import MetricsLogger, format_postfix, progress_bar


def test_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = str(tmp_path / "logs")
    logger = MetricsLogger(log_dir, enabled=True)
    logger.log(1, {"loss": 2.5, "lr": 1e-5, "tokens": 300})
    # read back before close: each line is flushed as it is written
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == [{"step": 1, "loss": 2.5, "lr": 1e-5,
                                                     "tokens": 300.0}]
    logger.log(2, {"loss": torch.tensor(1.25), "grad_norm": np.float32(0.5)})
    logger.close()
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert lines[1] == {"step": 2, "loss": 1.25, "grad_norm": 0.5}
    assert all(type(v) is float for line in lines for k, v in line.items() if k != "step")

    assert glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    acc = EventAccumulator(log_dir)
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr", "tokens", "grad_norm"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([2.5, 1.25])
    assert acc.Scalars("lr")[0].value == pytest.approx(1e-5, rel=1e-6)

    # resume appends
    with MetricsLogger(log_dir, enabled=True) as again:
        again.log(3, {"loss": float("nan")})
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == [1, 2, 3] and math.isnan(lines[2]["loss"])


def test_bad_metrics_rejected(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True)
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3.0})
    with pytest.raises(TypeError, match="'name'"):
        logger.log(1, {"name": "abc"})
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(1, {"loss": 1.0})


def test_disabled_writes_nothing(tmp_path):
    log_dir = tmp_path / "rank1"
    logger = MetricsLogger(str(log_dir), enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not log_dir.exists() and logger.jsonl_path is None
    none_dir = MetricsLogger(None, enabled=True)
    none_dir.log(1, {"loss": 1.0})
    none_dir.close()


def test_progress_bar_and_postfix():
    assert format_postfix({"train/loss": 0.123456, "lr": 1e-5, "tokens_per_s": 1234.6,
                           "grad_norm": 3.0}) == {"loss": "0.1235", "lr": "1.00e-05",
                                                  "tok/s": "1235"}
    assert format_postfix({"loss": float("inf")}) == {"loss": "inf"}
    assert format_postfix({"grad_norm": 1.0}) == {}
    bar = progress_bar(10, enabled=False, desc="sft")
    assert bar.disable
    bar.close()
    bar = progress_bar(10, enabled=True, desc="sft", initial=4)
    bar.update(1)
    assert not bar.disable and bar.n == 5 and bar.total == 10 and bar.desc.startswith("sft")
    bar.close()


def test_lines_printed_during_a_run_go_above_the_bar():
    """engine.run.run_loop prints checkpoint saves and stops through LinesAboveBar: each line
    is written with the bar cleared and then redrawn, never onto the bar's own line; a
    disabled bar is not touched; a partial line waits for its end (or a flush)."""
    import contextlib
    import io

    from engine.run.metrics import LinesAboveBar

    events = []

    class Bar:
        disable = False

        def clear(self):
            events.append("clear")

        def refresh(self):
            events.append("refresh")

    class Out(io.StringIO):
        def write(self, text):
            events.append(text)
            return super().write(text)

    out = Out()
    with contextlib.redirect_stdout(LinesAboveBar(Bar(), out)):
        print("[checkpoint] saved a", end="")
        assert events == []                       # no line end yet
        print("")
        print("[rl] stopping", flush=True)
    assert events == ["clear", "[checkpoint] saved a\n", "refresh",
                      "clear", "[rl] stopping\n", "refresh"]
    quiet, disabled = Out(), Bar()
    disabled.disable = True
    events.clear()
    with contextlib.redirect_stdout(LinesAboveBar(disabled, quiet)):
        print("x")
    assert events == ["x\n"]
