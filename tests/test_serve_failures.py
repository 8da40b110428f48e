"""`serve` when something fails, in process on the word-level tokenizer with a scripted backend
(tests/serve_fakes.py): non-finite log-probs become OpenAI-valid numbers (JSON and streamed);
an error after a stream started ends it with an error event and [DONE]; one failing request
of a batch gets its 503 while the others are answered; 503 and 500 bodies carry a short
message and the request id, the exception and its traceback go to the server log only."""
from __future__ import annotations

import json
import logging
import math
import threading
import time

import httpx
import pytest

import engine.serve.endpoint as endpoint_module
from engine.api.replies import finite
from tests.serve_fakes import ScriptedBackend, serving
from tools.tiny_models import build_tokenizer

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("serve_tok")), 200)


def _events(text: str) -> list:
    """The data of a server-sent event stream: parsed JSON, or the string "[DONE]"."""
    out = []
    for line in text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_non_finite_logprobs_are_valid_numbers_in_json_and_streams(tok):
    """Scores of NaN, -inf and +inf (a model whose logits overflowed): the completions reply
    with echo + logprobs and the chat reply with top_logprobs are 200 with strict JSON, NaN and
    -inf reported as -9999.0 and +inf as 0.0; streamed, every event parses and the stream ends
    with [DONE]."""
    assert (finite(NAN), finite(-INF), finite(INF), finite(-1.5), finite(-1e6)) == \
        (-9999.0, -9999.0, 0.0, -1.5, -9999.0)
    backend = ScriptedBackend(values=(NAN, -INF, INF, -0.5))
    with serving(tok, backend) as endpoint:
        url = endpoint.base_url
        body = {"prompt": [60, 61, 62], "max_tokens": 2, "echo": True, "logprobs": 1}
        r = httpx.post(f"{url}/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        lp = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))[
            "choices"][0]["logprobs"]
        # prompt 3 ids + reply 2 ids: 4 scores cycling NaN, -inf, +inf, -0.5
        assert lp["token_logprobs"] == [None, -9999.0, -9999.0, 0.0, -0.5]
        assert [list(d.values())[-1] for d in lp["top_logprobs"][1:]] == \
            [-9999.0, -9999.0, 0.0, -0.5]
        chat = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2,
                "logprobs": True, "top_logprobs": 2}
        r = httpx.post(f"{url}/chat/completions", json=chat, timeout=10)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert all(math.isfinite(e["logprob"]) and all(math.isfinite(t["logprob"])
                                                       for t in e["top_logprobs"])
                   for e in content) and len(content) == 2
        for route, req in (("completions", body), ("chat/completions", chat)):
            r = httpx.post(f"{url}/{route}", json={**req, "stream": True}, timeout=10)
            assert r.status_code == 200
            events = _events(r.text)
            assert events[-1] == "[DONE]" and len(events) > 3
            assert not any("error" in e for e in events[:-1]), events
            assert "NaN" not in r.text and "Infinity" not in r.text


def test_an_error_after_the_stream_started_ends_it_with_an_error_event(tok, monkeypatch,
                                                                       caplog):
    """A stream whose chunks fail after the first was sent (200 already out): the client gets
    the first chunk, one `data: {"error": {...}}` event (server_error, code stream_failed, the
    message naming the request id and nothing of the exception), then `data: [DONE]`; the
    exception with its traceback is in the server log under that id."""
    real = endpoint_module.completion_chunks

    def failing(*args):
        chunks = real(*args)
        yield chunks[0]
        raise RuntimeError(f"boom: {ScriptedBackend.SECRET}")

    monkeypatch.setattr(endpoint_module, "completion_chunks", failing)
    with serving(tok, ScriptedBackend()) as endpoint, \
            caplog.at_level(logging.ERROR, logger="engine.serve.errors"):
        r = httpx.post(f"{endpoint.base_url}/completions",
                       json={"prompt": "w1", "max_tokens": 2, "stream": True}, timeout=10)
    assert r.status_code == 200
    events = _events(r.text)
    assert len(events) == 3 and events[0]["object"] == "text_completion", events
    error, done = events[1]["error"], events[2]
    assert done == "[DONE]"
    assert error["type"] == "server_error" and error["code"] == "stream_failed"
    rid = events[0]["id"]
    assert rid in error["message"] and ScriptedBackend.SECRET not in r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and ScriptedBackend.SECRET in str(logged[0].exc_info[1])


def test_one_failing_request_does_not_fail_its_batch(tok, caplog):
    """Three requests in one batch, one whose prompt makes the generate call raise: the two
    others are answered 200 (the failed call is retried in halves), the failing one gets 503
    (code generation_failed) whose message names its request id (also X-Request-Id) and holds
    nothing of the exception; the exception's text and traceback are in the server log."""
    backend = ScriptedBackend(poison=66, blocked=True)
    with serving(tok, backend) as endpoint, \
            caplog.at_level(logging.ERROR, logger="engine.serve.errors"):
        url, got = f"{endpoint.base_url}/completions", {}

        def send(name, prompt):
            t = threading.Thread(target=lambda: got.__setitem__(name, httpx.post(
                url, json={"prompt": prompt, "max_tokens": 2, "seed": 1}, timeout=30)),
                daemon=True)
            t.start()
            return t

        threads = [send("first", [60])]
        assert backend.started.wait(10)
        threads += [send("good1", [61]), send("bad", [66]), send("good2", [62])]
        deadline = time.monotonic() + 10
        while len(endpoint.queue.pending) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(endpoint.queue.pending) == 3
        backend.release.set()
        for t in threads:
            t.join(timeout=10)
    assert [got[k].status_code for k in ("first", "good1", "good2", "bad")] == \
        [200, 200, 200, 503], got["bad"].text
    assert backend.calls[:2] == [1, 3] and sum(backend.calls) > 4   # the 3 retried in halves
    error = got["bad"].json()["error"]
    rid = got["bad"].headers["x-request-id"]
    assert error["code"] == "generation_failed" and error["type"] == "server_error"
    assert error["message"] == (f"generation failed (request id {rid}); the server log has "
                                "the details")
    assert ScriptedBackend.SECRET not in got["bad"].text and "RuntimeError" not in \
        got["bad"].text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(logged) == 1 and ScriptedBackend.SECRET in str(logged[0].exc_info[1])
    assert logged[0].exc_info[2] is not None                       # with its traceback


def test_a_bug_answers_500_with_a_request_id_and_logs_the_exception(tok, monkeypatch,
                                                                   caplog):
    """A bug while the reply is built: 500 (code internal_error) whose message names the
    request id (X-Request-Id too), nothing of the exception's type or text; the log has it."""
    def broken(*args):
        raise KeyError(ScriptedBackend.SECRET)

    monkeypatch.setattr(endpoint_module, "completion_reply", broken)
    with serving(tok, ScriptedBackend()) as endpoint, \
            caplog.at_level(logging.ERROR, logger="engine.serve.errors"):
        r = httpx.post(f"{endpoint.base_url}/completions",
                       json={"prompt": "w1", "max_tokens": 2}, timeout=10)
    assert r.status_code == 500
    rid, error = r.headers["x-request-id"], r.json()["error"]
    assert rid.startswith("cmpl-") and error["code"] == "internal_error"
    assert error["message"] == (f"internal error (request id {rid}); the server log has the "
                                "details")
    assert ScriptedBackend.SECRET not in r.text and "KeyError" not in r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and isinstance(logged[0].exc_info[1], KeyError)


def _queue_behind_first(endpoint, backend, bodies: list[dict]) -> tuple[dict, list]:
    """Send one request that holds the (blocked) backend, then `bodies` (queued in this order
    behind it); returns (name -> response, threads) with the backend still blocked."""
    url, got = f"{endpoint.base_url}/completions", {}

    def send(name, body):
        t = threading.Thread(target=lambda: got.__setitem__(name, httpx.post(
            url, json=body, timeout=30)), daemon=True)
        t.start()
        return t

    threads = [send("first", {"prompt": [60], "max_tokens": 2, "seed": 1})]
    assert backend.started.wait(10)
    for i, body in enumerate(bodies):   # one at a time: the queue holds them in this order
        threads.append(send(i, body))
        deadline = time.monotonic() + 10
        while len(endpoint.queue.pending) <= i and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(endpoint.queue.pending) == i + 1
    return got, threads


@pytest.mark.parametrize("remember", [True, False])
def test_a_failing_request_costs_its_halving_once_and_its_twins_no_call(tok, remember):
    """Issue 82 defect 3. Eight queued requests, two of them twins that make generate raise
    (the same poison prompt, different seeds): the halving isolates the first twin alone
    (calls of 8, 4, 2, 1, then the good 2 and 4) and the second is answered 503 without a
    call of its own (negative control, remember=False (FailedTwins ttl 0): one call more,
    the second twin retried alone). A third twin arriving afterwards gets 503 repeated_failure
    at admission with a Retry-After, no generate call (control: one more failing call); a
    request with another prompt is still served."""
    from engine.serve.batching import FailedTwins

    backend = ScriptedBackend(poison=66, blocked=True)
    with serving(tok, backend) as endpoint:
        if not remember:
            endpoint.queue.twins = FailedTwins(ttl_s=0)
        bodies = [{"prompt": [66, 70], "max_tokens": 2, "seed": s} for s in (1, 2)] + \
            [{"prompt": [71 + i], "max_tokens": 2, "seed": 1} for i in range(6)]
        got, threads = _queue_behind_first(endpoint, backend, bodies)
        backend.release.set()
        for t in threads:
            t.join(timeout=10)
        assert [got[i].status_code for i in range(8)] == [503] * 2 + [200] * 6
        # depth first: 8 fails, its first half 4 fails, 2 fails, the first twin alone fails
        assert backend.calls == [1, 8, 4, 2, 1] + ([] if remember else [1]) + [2, 4]
        before = len(backend.calls)
        third = httpx.post(f"{endpoint.base_url}/completions",
                           json={"prompt": [66, 70], "max_tokens": 2}, timeout=10)
        assert third.status_code == 503
        if remember:
            assert third.json()["error"]["code"] == "repeated_failure"
            assert 1 <= int(third.headers["retry-after"]) <= 60
            assert len(backend.calls) == before and endpoint._accepted == 9
        else:
            assert third.json()["error"]["code"] == "generation_failed"
            assert len(backend.calls) == before + 1
        other = httpx.post(f"{endpoint.base_url}/completions",
                           json={"prompt": [66, 71], "max_tokens": 1}, timeout=10)
        assert other.status_code == 503   # another prompt: a twin of nothing, generated
        ok = httpx.post(f"{endpoint.base_url}/completions",
                        json={"prompt": [67, 70], "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200


def test_failed_twins_are_bounded_and_expire():
    """FailedTwins keeps at most `capacity` fingerprints, the oldest evicted first, each for
    ttl_s seconds (a fake clock); the seed is not part of the fingerprint, the prompt and
    every sampling setting are."""
    from engine.api.backend import GenerateRequest
    from engine.serve.batching import FailedTwins, fingerprint

    now = [0.0]
    twins = FailedTwins(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    a, b, c = (GenerateRequest((i, 5), 4, 1.0, 1.0, seed=3) for i in (1, 2, 3))
    assert fingerprint(a) == fingerprint(GenerateRequest((1, 5), 4, 1.0, 1.0, seed=99))
    assert len({fingerprint(a), fingerprint(GenerateRequest((1, 5), 5, 1.0, 1.0, 3)),
                fingerprint(GenerateRequest((1, 5), 4, 0.5, 1.0, 3)),
                fingerprint(GenerateRequest((1, 5), 4, 1.0, 0.9, 3)),
                fingerprint(GenerateRequest((1, 5), 4, 1.0, 1.0, 3, score_top_k=0))}) == 5
    twins.add(a)
    now[0] = 1.0
    twins.add(b)
    twins.add(c)                       # over capacity: a (the oldest) is forgotten
    now[0] = 2.0
    assert twins.left_s(a) is None and twins.left_s(b) == 9.0 and twins.left_s(c) == 9.0
    now[0] = 11.0
    assert twins.left_s(b) is None and len(twins.failed) == 1
