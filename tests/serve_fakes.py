"""In-process pieces of the serve tests (tests/test_serve_admission.py,
tests/test_serve_failures.py): the word-level tokenizer of tools.tiny_models, a scripted
GenerateBackend (blocked until released, failing on a poison prompt id, scores with chosen
values), and a ServeEndpoint served by a thread of its own."""
from __future__ import annotations

import contextlib
import threading

from engine.api.backend import GenerateResult, TokenScores
from engine.serve.endpoint import ServeEndpoint, ServeSettings

MAX_TOKENS, MAX_CONTEXT = 12, 200


class ScriptedBackend:
    """GenerateBackend: each request gets `reply` ids with log-prob -0.5; `blocked` holds the
    first call until `release` is set; a call holding a request whose prompt contains `poison`
    raises RuntimeError("boom: <secret>"); a scored request gets TokenScores whose log-probs
    cycle through `values` and whose top dicts hold k ids with those values."""

    SECRET = "s3cr3t-internal-detail"

    def __init__(self, reply=(5, 6), poison: int | None = None, blocked: bool = False,
                 values=(-0.25,)) -> None:
        self.reply, self.poison, self.values = list(reply), poison, list(values)
        self.started, self.release = threading.Event(), threading.Event()
        if not blocked:
            self.release.set()
        self.calls: list[int] = []
        self.requests: list = []      # every GenerateRequest generated, in call order

    def generate(self, requests):
        self.calls.append(len(requests))
        self.requests += requests
        self.started.set()
        self.release.wait(10)
        if any(self.poison in r.prompt_ids for r in requests):
            raise RuntimeError(f"boom: {self.SECRET}")
        out = []
        for r in requests:
            ids = self.reply[:r.max_tokens]
            result = GenerateResult(list(ids), [-0.5] * len(ids), "length")
            if r.score_top_k is not None:
                m = len(r.prompt_ids) + len(ids) - 1
                vals = [self.values[i % len(self.values)] for i in range(m)]
                result.scores = TokenScores(vals, [{7 + j: v for j in range(r.score_top_k)}
                                                   for v in vals])
            out.append(result)
        return out


@contextlib.contextmanager
def serving(tok, backend, settings: ServeSettings | None = None, **kw):
    """A started ServeEndpoint on `tok` whose queue `backend` serves on a thread of its own
    (stopped, and the backend released, on exit)."""
    endpoint = ServeEndpoint(tok, settings or ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                             gather_s=kw.pop("gather_s", 0.0), request_log=None, **kw).start()
    stop = threading.Event()
    owner = threading.Thread(target=endpoint.serve, args=(backend, stop.is_set), daemon=True)
    owner.start()
    try:
        yield endpoint
    finally:
        backend.release.set()
        stop.set()
        owner.join(timeout=10)
        endpoint.stop()
