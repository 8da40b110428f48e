"""Log lines that used to mislead, each checked where it is made:

- the run loop prints a step's eval/* metrics (eval/loss) as a run-log line, progress bar or
  not (before, eval/loss reached only metrics.jsonl and the bar's postfix: a run with the bar
  off printed nothing between its header and `done`);
- a line printed while the progress bar is drawn starts a line of the log also when the bar
  and the lines share one file (stderr merged into stdout: before, each line followed the bar's
  carriage-return text, so `grep '^\\[compile\\]'` found nothing);
- a live stream whose client leaves cancels its choices without asyncio logging
  "_GatheringFuture exception was never retrieved" (the control: a plain cancel logs it);
- the access log line of a stream its client cut is 499, like a request answered 499 (before:
  200), on a real uvicorn server; a stream read to its end stays 200.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import socket
import time
from types import SimpleNamespace

import pytest
from tqdm import tqdm

from engine.run.metrics import LinesAboveBar


def _bar_and_lines(tmp_path, merged: bool) -> tuple[str, str]:
    """Print two lines through LinesAboveBar while a bar is drawn; the bar writes to one
    file, the lines to the same file descriptor (`2>&1`) or to a second file. Returns the
    texts of (the bar's file, the lines' file)."""
    bar_path, out_path = tmp_path / "bar.log", tmp_path / "out.log"
    bar_file = open(bar_path, "w")
    out = os.fdopen(os.dup(bar_file.fileno()), "w") if merged else open(out_path, "w")
    bar = tqdm(total=3, desc="sft", file=bar_file, disable=False, mininterval=0)
    with contextlib.redirect_stdout(LinesAboveBar(bar, out)):
        for step in (1, 2):
            bar.update(1)
            print(f"[compile] after step {step}: 10 graphs, 0 recompiles, 0 graph breaks")
    bar.close()
    out.close()
    bar_file.close()
    # as bytes: read_text's universal newlines would turn the bar's carriage returns into
    # line ends
    return (bar_path.read_bytes().decode(),
            out_path.read_bytes().decode() if not merged else "")


def test_printed_lines_start_a_line_of_a_log_shared_with_the_bar(tmp_path):
    merged, _ = _bar_and_lines(tmp_path, merged=True)
    compile_lines = [line for line in merged.split("\n") if line.startswith("[compile]")]
    assert compile_lines == ["[compile] after step 1: 10 graphs, 0 recompiles, 0 graph breaks",
                             "[compile] after step 2: 10 graphs, 0 recompiles, 0 graph breaks"]
    assert "sft:" in merged                               # the bar is still drawn
    _, separate = _bar_and_lines(tmp_path, merged=False)  # its own file: just the lines
    assert separate.splitlines() == compile_lines


def _run_loop(tmp_path, step_metrics: list[dict]):
    from engine.config.schema import SFTConfig
    from engine.run.run_loop import RunLoop

    cfg = SFTConfig()
    cfg.train.max_steps = len(step_metrics)
    cfg.logging.dir, cfg.logging.progress_bar = str(tmp_path), False
    engine = SimpleNamespace(guard=SimpleNamespace(raise_if_diverged=lambda: None))
    loop = RunLoop("sft", cfg, engine, {}, position=lambda done: None)
    return loop.run(0, lambda step: step_metrics[step])


def test_eval_metrics_reach_stdout_with_the_bar_off(tmp_path, capsys):
    _run_loop(tmp_path, [{"loss": 2.0}, {"loss": 1.5, "eval/loss": 1.23456},
                         {"loss": 1.25}])
    out = capsys.readouterr().out
    assert out.splitlines() == ["[sft] step 2: eval/loss 1.2346"]


def _gathering_messages(cancel) -> tuple[list[str], bool]:
    """The messages asyncio's exception handler got after a live stream's client left
    (the stream closed at its first chunk) and its futures were collected; whether the
    choice's future was cancelled (the owner thread then aborts it in the engine)."""
    from engine.serve import live

    messages: list[str] = []

    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: messages.append(context["message"]))
        future = concurrent.futures.Future()
        call = SimpleNamespace(kind="chat", include_usage=False, n=1, stop=None)
        stream = live.LiveStream(None, call, [[1]], "m", "r1", logging.getLogger("t"))
        events = stream._events([future], live.Latest(loop, 1), [None])
        assert '"role": "assistant"' in await events.__anext__()
        await events.aclose()                     # the client went away
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
        return future.cancelled()

    original = live.cancel_gone
    live.cancel_gone = cancel
    try:
        cancelled = asyncio.run(scenario())
    finally:
        live.cancel_gone = original
    return messages, cancelled


def test_a_client_leaving_a_live_stream_logs_nothing():
    from engine.serve.live import cancel_gone

    assert _gathering_messages(cancel_gone) == ([], True)
    # control: the plain cancel the stream did before logs the message on every disconnect
    messages, cancelled = _gathering_messages(lambda waiter: waiter.cancel())
    assert messages == ["_GatheringFuture exception was never retrieved"] and cancelled


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _wait_for(lines: list[str], prefix: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line {prefix!r}: {lines}")


def test_a_stream_the_client_cuts_is_logged_499():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from engine.api.http import log_requests, start_http, stop_http

    app = FastAPI()

    async def chunks(n: int | None):
        k = 0
        while n is None or k < n:
            yield f"data: {k}\n\n"
            k += 1
            await asyncio.sleep(0.02)

    @app.get("/endless")
    async def endless():
        return StreamingResponse(chunks(None), media_type="text/event-stream")

    @app.get("/short")
    async def short():
        return StreamingResponse(chunks(3), media_type="text/event-stream")

    handler, logger = _Lines(), logging.getLogger("test_run_logs.http")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log_requests(app, logger)
    server, thread, port = start_http(app, "127.0.0.1", 0, "test server", "")
    try:
        for path in ("/short", "/endless"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                got = b""
                while b"data: 2" not in got:
                    got += sock.recv(4096)
                if path == "/short":
                    while not got.endswith(b"0\r\n\r\n"):   # the chunked body's end
                        got += sock.recv(4096)
            assert _wait_for(handler.lines, f"GET {path} ").split()[2] == (
                "200" if path == "/short" else "499"), handler.lines
    finally:
        stop_http(server, thread)
        logger.removeHandler(handler)
    assert "the client closed the request before its end" in _wait_for(
        handler.lines, "GET /endless ")
