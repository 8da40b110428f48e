"""The agent endpoint (engine.rl.agent; docs/agents.md): episodes driven through the real
`openai` client and httpx against a deterministic scripted backend on the tools demo's
character-level Qwen-style template (tools/demo.py), and once against the HF rollout engine of
a tiny model. Token-in/token-out: a trajectory's ids are the prompt, each call's sampled ids as
generated (deliberately non-canonical: re-tokenising their text gives other ids) and the
template-delta observation ids; rewritten history and retries start new trajectories; seeds
depend on (episode, call index) only; concurrent episodes are batched (the gather path) or
share engine steps (the step path over a scripted step driver: its events say which calls
ran in one step, and admission's 429 / 410 / 503 hold there); over-limit calls get 400s;
tool calls, log-probs, /v1/models; the runner's failures are contained."""
from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time

import httpx
import openai
import pytest
import torch

from engine.api.backend import GenerateRequest, GenerateResult, call_seed
from engine.api.batcher import GenerateQueue
from engine.api.requests import ApiError, Limits, parse_chat, parse_completion
from engine.data.observation import observation_ids
from engine.rl.agent.runner import AgentRunner, check_result
from engine.rl.agent.server import AgentServer
from engine.generation.base import Generation
from engine.generation.sampling_backend import SamplingBackend, StepBackend
from engine.generation.steps import StepOutput
from tools.char_tokenizer import build_char_tokenizer
from tools.demo import TOOLS_TEMPLATE, calculator_tools

LIMITS = Limits(max_new_tokens=120, seq_length=800, temperature=1.0, top_p=1.0, max_turns=6)
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(None, "qwen2.5", template=TOOLS_TEMPLATE)


def default_script(prompt: str, seed: int) -> str:
    """A reply naming the seed; "<think>" spelled out character by character (see ids())."""
    if "tools:" in prompt and "<tool_response>" not in prompt:
        return CALL
    if "long" in prompt:
        return "y" * 300
    return f"<think>ok {seed % 997}"


class ScriptedBackend:
    """Deterministic GenerateBackend: the reply to a request is script(prompt text, seed) as
    one id per character (so "<think>" is 7 ids where the tokenizer has one: re-tokenising the
    text would change the ids), then <|im_end|>; log-probs a function of (seed, position)."""

    def __init__(self, tok, script=default_script, delay_s: float = 0.0) -> None:
        self.tok, self.script, self.delay_s = tok, script, delay_s
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.batches: list[int] = []
        self.seen: list = []

    def ids(self, text: str) -> list[int]:
        return [self.tok.convert_tokens_to_ids(c) if c != "\n" else
                self.tok.encode("\n", add_special_tokens=False)[0] for c in text]

    def generate(self, requests):
        self.batches.append(len(requests))
        self.seen += requests
        time.sleep(self.delay_s)
        out = []
        for r in requests:
            text = self.script(self.tok.decode(list(r.prompt_ids)), r.seed)
            ids = self.ids(text) + [self.eot]
            lps = [-(((r.seed >> (j % 40)) % 1000) + 1) / 1000 for j in range(len(ids))]
            cut = len(ids) > r.max_tokens
            out.append(GenerateResult(ids[:r.max_tokens], lps[:r.max_tokens],
                                      "length" if cut else "stop"))
        return out


class ScriptedDriver:
    """A step driver (VLLMStepDriver's interface: add, abort, step, busy, steps, events) over
    ScriptedBackend's script: each step samples one more id of every running request, which
    finishes with ScriptedBackend's reply to it (the same ids, log-probs and finish reason).
    `hold(key)` True: that request does not advance this step. `max_running`: at most that
    many run at once, the others wait inside the driver and count as added when they start
    (an engine's max_num_seqs)."""

    def __init__(self, tok, max_running: int | None = None) -> None:
        self.script = ScriptedBackend(tok)
        self.max_running = max_running
        self.hold = lambda key: False
        self.waiting: dict[str, GenerateRequest] = {}
        self.running: dict[str, tuple[GenerateResult, int]] = {}   # key -> (reply, ids out)
        self.prompts: dict[str, str] = {}
        self.submitted, self.steps = 0, 0
        self.events: list[tuple[str, str, int]] = []

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, key, prompt, params, stream=False):
        self.submitted += 1
        self.prompts[key] = self.script.tok.decode(prompt)
        self.waiting[key] = GenerateRequest(tuple(prompt), params.max_new_tokens,
                                            params.temperature, params.top_p, params.seeds[0])
        self._start()

    def _start(self) -> None:
        for key in list(self.waiting):
            if self.max_running is None or len(self.running) < self.max_running:
                (reply,) = self.script.generate([self.waiting.pop(key)])
                self.running[key] = (reply, 0)
                self.events.append(("added", key, self.steps))

    def abort(self, key) -> None:
        self.waiting.pop(key, None)
        if self.running.pop(key, None) is not None:
            self.events.append(("aborted", key, self.steps))

    def step(self):
        if not any(not self.hold(k) for k in self.running):
            time.sleep(0.001)          # held: let the HTTP side move
            return []
        self.steps += 1
        out = []
        for key, (reply, n) in list(self.running.items()):
            if self.hold(key):
                continue
            self.running[key] = (reply, n + 1)
            if n + 1 < len(reply.ids):
                continue
            del self.running[key]
            self.events.append(("finished", key, self.steps))
            out.append(StepOutput(key, reply.ids, Generation(
                [], reply.ids, reply.logprobs, reply.finish_reason)))
        self._start()
        return out


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextlib.contextmanager
def serving(tok, backend, limits=LIMITS, **kw):
    """A started server whose generate requests a helper thread (the 'engine thread') serves."""
    server = AgentServer(tok, limits, **kw).start()
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(backend, stop.is_set), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.stop()


def render(tok, messages, tools=None) -> list[int]:
    """The ids of `messages` rendered with the generation prompt (a new trajectory's prompt)."""
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def sampled(backend, text: str) -> list[int]:
    return backend.ids(text) + [backend.eot]


# ----------------------------------------------------------------------------- exact ids


def send_call(server, got: dict, eid: str, body: dict) -> threading.Thread:
    """POST `body` to episode `eid`'s chat completions on a thread of its own; the response
    lands in got[eid]. Returns the started thread."""
    t = threading.Thread(target=lambda: got.__setitem__(eid, httpx.post(
        server.base_url(eid) + "/chat/completions", json=body, timeout=30)), daemon=True)
    t.start()
    return t

def test_two_calls_reuse_the_ids_exactly(tok):
    backend = ScriptedBackend(tok)
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=1234)
        c = client(server.base_url(ep.id))
        messages = [{"role": "user", "content": "hi"}]
        first = c.chat.completions.create(model="any", messages=messages,
                                          extra_body={"return_token_ids": True})
        reply = first.choices[0].message
        assert reply.content == f"<think>ok {1234 % 997}" and first.choices[0].finish_reason == "stop"
        messages += [reply, {"role": "user", "content": "again"}]   # the pydantic message
        second = c.chat.completions.create(model="any", messages=messages)
        trajectories = ep.trajectories()
    assert len(trajectories) == 1
    t = trajectories[0]
    prompt = render(tok, messages[:1])
    obs = observation_ids(tok, messages[:1], messages[2:])
    s1, s2 = sampled(backend, reply.content), sampled(backend, second.choices[0].message.content)
    assert t.token_ids == prompt + s1 + obs + s2
    assert t.loss_mask == [0] * len(prompt) + [1] * len(s1) + [0] * len(obs) + [1] * len(s2)
    assert t.turns == 2 and t.calls == [0, 1] and t.finish_reason == "stop"
    assert first.choices[0].token_ids == s1 and first.prompt_token_ids == prompt
    lps = [x for r, s in zip(backend.seen, (s1, s2)) for x in
           [-(((r.seed >> (j % 40)) % 1000) + 1) / 1000 for j in range(len(s))]]
    assert [x for x, m in zip(t.rollout_logprobs, t.loss_mask) if m] == lps
    assert all(x == 0.0 for x, m in zip(t.rollout_logprobs, t.loss_mask) if not m)
    assert [r.seed for r in backend.seen] == [call_seed(1234, 0), call_seed(1234, 1)]
    # negative control: re-rendering the conversation re-tokenises "<think>" to one id
    again = [messages[0], {"role": "assistant", "content": reply.content}, messages[2]]
    assert render(tok, again) != \
        prompt + s1 + obs


def test_rewritten_history_and_retries_start_new_trajectories(tok):
    backend = ScriptedBackend(tok)
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=7)
        c = client(server.base_url(ep.id))
        user = [{"role": "user", "content": "q"}]
        text = c.chat.completions.create(model="m", messages=user).choices[0].message.content
        follow = [{"role": "user", "content": "more"}]
        c.chat.completions.create(model="m", messages=user + [
            {"role": "assistant", "content": text + " (edited)"}] + follow)      # rewritten
        c.chat.completions.create(model="m", messages=user)                       # a retry
        c.chat.completions.create(model="m", messages=user + [
            {"role": "assistant", "content": text}] + follow)                     # extends call 0
        trajectories = ep.trajectories()
    assert [t.calls for t in trajectories] == [[1], [2], [0, 3]]
    assert [t.turns for t in trajectories] == [1, 1, 2]
    s0 = sampled(backend, text)
    prompt = render(tok, user)
    assert trajectories[2].token_ids[:len(prompt) + len(s0)] == prompt + s0
    assert trajectories[0].prompt_ids != prompt       # the edited history rendered afresh


def test_a_cut_reply_is_closed_and_stop_strings_cut_the_ids(tok):
    backend = ScriptedBackend(tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=5)
        c = client(server.base_url(ep.id))
        user = [{"role": "user", "content": "q"}]
        cut = c.chat.completions.create(model="m", messages=user, max_tokens=4)
        assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == "<thi"
        more = user + [{"role": "assistant", "content": "<thi"},
                       {"role": "user", "content": "go"}]
        stopped = c.chat.completions.create(model="m", messages=more, stop=["ok"])
        assert stopped.choices[0].message.content == "<think>" and \
            stopped.choices[0].finish_reason == "stop"
        big = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "long"}],
                                        max_tokens=10 ** 6)
        assert big.usage.completion_tokens == LIMITS.max_new_tokens    # capped
        assert big.choices[0].finish_reason == "length"
        t = ep.trajectories()[0]
    prompt = render(tok, user)
    obs = observation_ids(tok, user, more[2:])
    kept = backend.ids("<think>")                    # cut before the stop string "ok"
    assert t.token_ids == prompt + backend.ids("<thi") + [eot] + obs + kept
    assert t.loss_mask[len(prompt) + 4] == 0          # the closing <|im_end|> is not trained


def test_tool_calls_are_parsed_and_the_tool_result_extends_the_call(tok):
    backend = ScriptedBackend(tok)
    tools = calculator_tools()
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=3)
        c = client(server.base_url(ep.id))
        messages = [{"role": "user", "content": "What is 6*7?"}]
        r = c.chat.completions.create(model="m", messages=messages, tools=tools)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "calculate"
        assert json.loads(call.function.arguments) == {"expression": "6*7"}
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        final = c.chat.completions.create(model="m", messages=messages, tools=tools)
        assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
        (t,) = ep.trajectories()
    prompt = render(tok, messages[:1], tools)
    obs = observation_ids(tok, messages[:1], messages[2:], tools)
    assert t.token_ids == prompt + sampled(backend, CALL) + obs + sampled(
        backend, final.choices[0].message.content)


def test_logprobs_n_and_models(tok):
    backend = ScriptedBackend(tok)
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=11)
        c = client(server.base_url(ep.id))
        assert [m.id for m in c.models.list().data] == ["policy"]
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                      logprobs=True, n=2)
        trajectories = ep.trajectories()
    assert [s.seed for s in backend.seen] == [call_seed(11, 0, 0), call_seed(11, 0, 1)]
    assert len(trajectories) == 2                       # each choice is a trajectory
    for choice, t in zip(r.choices, trajectories):
        got = [x.logprob for x in choice.logprobs.content]
        assert got == [x for x, m in zip(t.rollout_logprobs, t.loss_mask) if m]
        assert "".join(x.token for x in choice.logprobs.content) == \
            choice.message.content + "<|im_end|>"


def test_completions_reuse_text_and_ids(tok):
    backend = ScriptedBackend(tok, script=lambda prompt, seed: f" <think>{seed % 10}")
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=21)
        c = client(server.base_url(ep.id))
        first = c.completions.create(model="m", prompt="abc", logprobs=0)
        text = first.choices[0].text
        c.completions.create(model="m", prompt="abc" + text + " more")
        (t,) = ep.trajectories()
        ids = httpx.post(server.base_url(ep.id) + "/completions",
                         json={"prompt": [5, 6, 7], "return_token_ids": True}).json()
    s0 = sampled(backend, f" <think>{call_seed(21, 0) % 10}")
    s1 = sampled(backend, f" <think>{call_seed(21, 1) % 10}")
    assert t.token_ids == tok.encode("abc") + s0 + tok.encode(" more", add_special_tokens=False) + s1
    assert len(first.choices[0].logprobs.token_logprobs) == len(s0)
    assert ids["prompt_token_ids"] == [5, 6, 7] and ids["choices"][0]["token_ids"][-1] == backend.eot


# ----------------------------------------------------------------------------- refusals

def test_over_limit_requests_get_clear_400s(tok):
    backend = ScriptedBackend(tok)
    # the prompt renders to 20 ids: 20 + 40 new tokens do not fit in 50 + 1
    limits = Limits(max_new_tokens=40, seq_length=50, temperature=1.0, top_p=1.0, max_turns=2)
    user = [{"role": "user", "content": "q"}]
    with serving(tok, backend, limits) as server:
        ep = server.open_episode(seed=1)
        url = server.base_url(ep.id)
        c = client(url)
        cases = {"temperature": dict(temperature=0.5), "n": dict(n=99),
                 "stop": dict(stop=["a", "b", "c", "d", "e"]),
                 "frequency_penalty": dict(frequency_penalty=0.5),
                 "top_logprobs": dict(logprobs=True, top_logprobs=3)}
        for param, kw in cases.items():
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="m", messages=user, **kw)
            assert e.value.body["param"] == param, (param, e.value.body)
        with pytest.raises(openai.BadRequestError, match="context length exceeded"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 80}])
        with pytest.raises(openai.BadRequestError, match="context length exceeded"):
            c.chat.completions.create(model="m", messages=user, max_tokens=40)
        raw = httpx.post(url + "/chat/completions", content=b"{not json")
        assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
        assert httpx.post(url + "/chat/completions", json={"messages": user, "stream": True}
                          ).status_code == 400
        assert httpx.post(url + "/chat/completions", json={"messages": user, "foo": 1}
                          ).json()["error"]["message"] == "unsupported parameter 'foo'"
        for _ in range(2):
            c.chat.completions.create(model="m", messages=user, max_tokens=5)
        with pytest.raises(openai.BadRequestError, match="env.max_turns"):
            c.chat.completions.create(model="m", messages=user, max_tokens=5)
        server.close_episode(ep.id)
        assert httpx.post(url + "/chat/completions", json={"messages": user}).status_code == 410
        assert httpx.get(url.replace(ep.id, "nope") + "/models").status_code == 404
    assert len(backend.seen) == 2        # nothing refused reached the backend


def test_an_episode_cannot_reach_another_from_its_url(tok):
    """Episode ids carry 128 random bits: nothing derived from episode A's URL reaches a live
    episode B (404); B's real URL works. Negative control: the old scheme ("<n>-<server
    token>") let A's id with the sequence part changed reach B."""
    import base64

    from engine.rl.agent import server as server_module

    user = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}

    def derived(a: str) -> list[str]:   # what a scaffold could derive from A's id
        number, _, token = a.partition("-")
        out = [f"{int(number) + d}-{token}" for d in (1, -1)] if number.isdigit() else []
        out += [a[:-1] + c for c in "AQgw"] + [a[1:], a + "0", a.upper()]
        return [x for x in out if x != a]

    with serving(tok, ScriptedBackend(tok)) as server:
        a, b = server.open_episode(seed=1), server.open_episode(seed=2)
        for e in (a, b):
            assert len(base64.urlsafe_b64decode(e.id + "==")) == 16   # 128 bits
        assert a.id[:4] != b.id[:4] and b.id not in derived(a.id)
        for eid in derived(a.id):
            url = server.base_url(a.id).replace(a.id, eid)
            assert httpx.post(url + "/chat/completions", json=user).status_code == 404, eid
        assert httpx.post(server.base_url(b.id) + "/chat/completions", json=user
                          ).status_code == 200 and b.calls == 1 and a.calls == 0
        server.close_episode(b.id)
        assert httpx.get(server.base_url(b.id) + "/models").status_code == 410
        # negative control: with the old ids, A's id with its number + 1 is B's URL
        counter = iter(range(10))
        token = "0123abcd"
        server._new_id = lambda: f"{next(counter)}-{token}"
        a, b = server.open_episode(seed=1), server.open_episode(seed=2)
        url = server.base_url(a.id).replace(a.id, derived(a.id)[0])
        assert httpx.post(url + "/chat/completions", json=user).status_code == 200
        assert b.calls == 1 and a.calls == 0
    assert server_module.new_episode_id() != server_module.new_episode_id()


def test_malformed_content_parts_get_400_naming_the_part(tok, monkeypatch, caplog):
    """A non-object (or untyped, or textless) content part is a 400 naming the part, never a
    500 (the openai client retries 5xx); nothing reaches the backend. Negative control:
    without the part check (engine.data.rows.check_messages) the same request is a 500."""
    import engine.api.requests as requests_module

    backend = ScriptedBackend(tok)
    with serving(tok, backend) as server:
        url = server.base_url(server.open_episode(seed=1).id) + "/chat/completions"
        for parts, words in ((["text"], "content[0] must be a part"),
                             ([{"type": "text", "text": "a"}, 1], "content[1] must be a part"),
                             ([None], "content[0] must be a part"),
                             ([{"type": "text"}], "content[0].text must be a string"),
                             ([{"type": "image"}], "a part other than text")):
            r = httpx.post(url, json={"messages": [{"role": "user", "content": parts}]})
            assert r.status_code == 400, (parts, r.text)
            assert words in r.json()["error"]["message"] and \
                r.json()["error"]["param"] == "messages", (parts, r.json())
        monkeypatch.setattr(requests_module, "check_messages", lambda m, *_: m)
        with caplog.at_level(logging.ERROR, logger="engine.rl.agent.errors"):
            r = httpx.post(url, json={"messages": [{"role": "user", "content": ["text"]}]})
        assert r.status_code == 500
        # The bug's 500 names the request, never the exception (engine.api.failures): its
        # type and text go to the server's error log.
        rid = r.headers["x-request-id"]
        assert r.json()["error"]["message"] == (f"internal error (request id {rid}); the "
                                                "server log has the details"), r.text
        assert "Error" not in r.text and rid in caplog.text and "Error" in caplog.text
    assert not backend.seen


def keyed_agent(base_url: str, row: dict, api_key: str | None = None) -> float:
    """An agent function taking env.agent_api_key (tests of the key)."""
    reply = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30
                          ).chat.completions.create(model="m", messages=[
                              {"role": "user", "content": row["prompt"]}])
    with pytest.raises(openai.AuthenticationError):   # another key: 401
        client(base_url).models.list()
    return float(len(reply.choices[0].message.content))


def test_an_api_key_guards_the_endpoint_and_reaches_the_function(tok):
    """env.agent_api_key: the function is called with api_key=KEY and its client's calls
    work; a request without `Authorization: Bearer KEY` (none, or another key) gets 401 with
    OpenAI's body and reaches nothing. Negative control: without a key the same bare request
    is served. agent_problems checks the key and that the function takes it."""
    from types import SimpleNamespace

    from engine.rl.agent.checks import agent_problems

    user = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}
    backend = ScriptedBackend(tok)
    with AgentServer(tok, LIMITS, api_key="s3cret") as server:
        (outcome,) = AgentRunner(server, keyed_agent, "tests:keyed", None, 20).run(
            backend, [{"prompt": "p"}], [7])
        url = server.base_url(server.open_episode(seed=1).id)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url + "/chat/completions", json=user, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(url + "/models", headers={"Authorization": "Bearer s3cret"}
                         ).status_code == 200
    assert outcome.error is None and outcome.calls == 1 and len(backend.seen) == 1
    with serving(tok, ScriptedBackend(tok)) as server:    # no key: open as before
        url = server.base_url(server.open_episode(seed=1).id)
        assert httpx.post(url + "/chat/completions", json=user).status_code == 200
    cfg = SimpleNamespace(   # the keys agent_problems reads, as engine.rl.config has them
        env=SimpleNamespace(fn=None, agent=None, agent_concurrency=None, agent_timeout_s=600.0,
                            agent_host="127.0.0.1", agent_port=0, max_turns=4),
        rollout=SimpleNamespace(backend="hf"), reward=SimpleNamespace(
            model=SimpleNamespace(path=None)))
    cfg.env.agent, cfg.env.agent_api_key = "tests.test_agent_server:keyed_agent", "k"
    assert agent_problems(cfg) == []
    cfg.env.agent = "tests.test_agent_server:two_call_agent"      # takes no api_key
    assert "give it an api_key parameter" in " ".join(agent_problems(cfg))
    cfg.env.agent, cfg.env.agent_api_key = "tests.test_agent_server:keyed_agent", "a b"
    assert "env.agent_api_key must be" in " ".join(agent_problems(cfg))
    cfg.env.agent_api_key = None
    assert agent_problems(cfg) == []


def test_a_body_over_the_limit_gets_413(tok):
    """max_body_bytes: a body over it is a 413 naming the limit, whether it declares its
    length or comes chunked; a body within it is served. Negative control: the default limit
    (16 MiB) serves the same large body."""
    small = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}
    big = json.dumps({**small, "user": "u" * 3000}).encode()   # `user`: accepted, ignored
    with serving(tok, ScriptedBackend(tok), max_body_bytes=2000) as server:
        url = server.base_url(server.open_episode(seed=1).id) + "/chat/completions"
        for content in (big, iter([big[:1500], big[1500:]])):      # sized, chunked
            r = httpx.post(url, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "limit of 2000 bytes" in r.json()["error"][
                "message"], r.text
        assert httpx.post(url, json=small).status_code == 200
    with serving(tok, ScriptedBackend(tok)) as server:
        url = server.base_url(server.open_episode(seed=1).id) + "/chat/completions"
        assert httpx.post(url, content=big).status_code == 200


# ----------------------------------------------------------------------------- the runner

def two_call_agent(base_url: str, row: dict) -> float:
    """The scaffold of the runner tests: two chat calls, with some jitter between them."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    rng = random.Random(row.get("jitter_seed"))
    time.sleep(rng.random() * row.get("jitter", 0.0))
    r = c.chat.completions.create(model="m", messages=messages)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "sure?"}]
    time.sleep(rng.random() * row.get("jitter", 0.0) + row.get("tool_s", 0.0))
    r = c.chat.completions.create(model="m", messages=messages)
    return float(len(r.choices[0].message.content))


def run_agent(tok, function, rows, seeds, concurrency=None, timeout_s=60.0, delay_s=0.0,
              driver=None, **kw):
    """The runner's episodes on the gather path (ScriptedBackend), or with `driver` on the
    step path (StepBackend over it)."""
    backend = ScriptedBackend(tok, delay_s=delay_s) if driver is None else StepBackend(driver)
    with AgentServer(tok, LIMITS, **kw) as server:
        t0 = time.perf_counter()
        outcomes = AgentRunner(server, function, "tests:agent", concurrency, timeout_s).run(
            backend, rows, seeds)
        wall = time.perf_counter() - t0
    return outcomes, backend, server.queue.stats, wall


def test_seeds_depend_only_on_episode_and_call_index(tok):
    seeds = [101, 202, 303, 404, 505, 606]
    runs = []
    for concurrency, jitter in ((None, 0.0), (1, 0.0), (3, 0.05)):
        rows = [{"prompt": f"p{i}", "jitter": jitter, "jitter_seed": i * 7 + len(runs)}
                for i in range(len(seeds))]
        outcomes, *_ = run_agent(tok, two_call_agent, rows, seeds, concurrency)
        runs.append([(o.reward, [(t.token_ids, t.loss_mask, t.rollout_logprobs)
                                 for t in o.trajectories]) for o in outcomes])
        assert all(o.error is None and len(o.trajectories) == 1 for o in outcomes)
    assert runs[0] == runs[1] == runs[2]
    # negative control: another seed samples other ids
    other, *_ = run_agent(tok, two_call_agent, [{"prompt": "p0"}], [102])
    assert other[0].trajectories[0].token_ids != runs[0][0][1][0][0]


def running_steps(events) -> dict[str, range]:
    """key -> the engine steps it ran in, from a step driver's events (("added" |
    "finished" | "aborted", key, steps run before)): added before step a+1, finished in
    step f, so it ran in steps a+1..f."""
    added = {k: n for kind, k, n in events if kind == "added"}
    return {k: range(added[k] + 1, n + 1) for kind, k, n in events
            if kind in ("finished", "aborted") and k in added}


def most_sharing(events) -> int:
    """The most requests that ran in one engine step."""
    count: dict[int, int] = {}
    for steps in running_steps(events).values():
        for n in steps:
            count[n] = count.get(n, 0) + 1
    return max(count.values(), default=0)


def test_concurrent_episodes_share_engine_steps(tok):
    """The step path (continuous batching over a step driver): 16 lock-step episodes of 2
    calls; the driver runs no step until their 16 first calls are in (`hold`), so all 16
    share the first steps: every call answered, the trajectories those of the gather path
    (ScriptedBackend, the same seeded script). Events, not clocks. Negative control: a driver
    that runs one request at a time (max_running=1) never has two in one step."""
    rows = [{"prompt": f"p{i}"} for i in range(16)]
    gathered, *_ = run_agent(tok, two_call_agent, rows, list(range(16)))
    for max_running, sharing in ((None, 16), (1, 1)):   # the second: the negative control
        driver = ScriptedDriver(tok, max_running=max_running)
        driver.hold = lambda key, d=driver: d.submitted < 16
        outcomes, *_ = run_agent(tok, two_call_agent, rows, list(range(16)), driver=driver)
        assert all(o.error is None for o in outcomes)
        assert [[t.token_ids for t in o.trajectories] for o in outcomes] == \
            [[t.token_ids for t in o.trajectories] for o in gathered]
        assert sum(e[0] == "finished" for e in driver.events) == 32
        assert most_sharing(driver.events) == sharing, driver.events


def test_a_call_back_from_its_tool_joins_the_running_step(tok):
    """Uneven tools: episode A's long call (120 tokens) is held in the engine until episode
    B, which makes 3 short calls one after another once A's runs, returned; each of B's
    calls is added while A's runs and finishes before it (B never waits for A's reply, as a
    gather wave would). Negative control: the predicate rejects batch-wave events (B's call
    added after A's finished)."""
    done = threading.Event()

    def agent(base_url: str, row: dict) -> float:
        c = client(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        if row["calls"] == 3:      # B starts once A's long call runs
            wait_for(lambda: any("long" in driver.prompts[k] for k in list(driver.running)),
                     "A's call in the engine")
        for _ in range(row["calls"]):
            r = c.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        if row["calls"] == 3:
            done.set()
        return 1.0

    driver = ScriptedDriver(tok)
    driver.hold = lambda key: not done.is_set() and "long" in driver.prompts[key]
    outcomes, *_ = run_agent(tok, agent, [{"prompt": "long", "calls": 1},
                                          {"prompt": "b", "calls": 3}], [1, 2], driver=driver)
    assert all(o.error is None for o in outcomes) and [o.calls for o in outcomes] == [1, 3]
    assert len(outcomes[0].trajectories[0].response_ids) == LIMITS.max_new_tokens   # cut

    def joined(events, prompts) -> bool:
        ran = running_steps(events)
        (a,) = [k for k in ran if "long" in prompts[k]]
        b = [k for k in ran if k != a]
        return len(b) == 3 and all(ran[a].start <= ran[k].start and ran[k].stop <
                                   ran[a].stop for k in b)

    assert joined(driver.events, driver.prompts), driver.events
    wave = [("added", "a", 0), ("finished", "a", 120)] + [
        e for k in range(3) for e in (("added", f"b{k}", 120 + 10 * k),
                                      ("finished", f"b{k}", 130 + 10 * k))]
    assert not joined(wave, {"a": "long", "b0": "", "b1": "", "b2": ""})


def test_step_path_admission_429_410_and_503(tok):
    """The step path keeps admission: with max_pending=1 a call running in the engine counts
    (another episode's call gets 429 queue_full, a body over max_body_bytes too: refused
    before it is read); closing its episode aborts it in the engine
    and answers it 410; once the server stops a call gets 503 server_stopping. Negative
    control: unbounded, the second call is admitted and runs beside the first."""
    user = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}
    for bound in (1, None):
        driver = ScriptedDriver(tok)
        driver.hold = lambda key: True            # nothing finishes: the calls stay running
        with serving(tok, StepBackend(driver), max_pending=bound,
                     max_body_bytes=2000) as server:
            a, b = server.open_episode(seed=1), server.open_episode(seed=2)
            got: dict[str, httpx.Response] = {}

            def send(eid: str) -> threading.Thread:
                return send_call(server, got, eid, user)

            first = send(a.id)
            wait_for(lambda: driver.running, "a's call in the engine")
            big = json.dumps({**user, "user": "u" * 3000}).encode()   # over max_body_bytes
            refused = httpx.post(server.base_url(b.id) + "/chat/completions", content=big)
            if bound == 1:     # 429 before the body is read (the unbounded control: 413)
                full = httpx.post(server.base_url(b.id) + "/chat/completions", json=user)
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
                assert b.calls == 0 and refused.status_code == 429
            else:
                assert refused.status_code == 413
                second = send(b.id)
                wait_for(lambda: len(driver.running) == 2, "b's call beside a's")
            server.close_episode(a.id)
            first.join(timeout=10)
            assert got[a.id].status_code == 410 and "takes no more calls" in got[a.id].text
            assert [e[0] for e in driver.events if e[1].startswith(a.id)] == \
                ["added", "aborted"]
            if bound is None:
                server.close_episode(b.id)
                second.join(timeout=10)
            server.queue.close("the server is stopping")
            stopped = httpx.post(server.base_url(server.open_episode(seed=3).id)
                                 + "/chat/completions", json=user)
            assert stopped.status_code == 503
            assert stopped.json()["error"]["code"] == "server_stopping"


def test_batching_rule_waits_for_expected_episodes_only():
    """GenerateQueue alone, its rule (wait_s) read at chosen times: a request waits while
    another live episode is expected (just answered: gather_s; started without a call:
    max_wait_s) and goes once that window ends, or at once when every live episode is pending;
    next_batch keeps to the rule (it returns no earlier than the window's end)."""
    t0 = time.monotonic()
    live = {"a": (t0, 1), "b": (t0, 1)}
    q = GenerateQueue(lambda: dict(live), lambda eid: None, gather_s=0.2, max_wait_s=1.0)
    request = GenerateRequest((1,), 1, 1.0, 1.0, 0)
    q.responded("b", 0)                          # b was just answered
    answered = q.answered["b"]
    q.submit("a", request)
    arrived = q.pending[0].arrived
    assert q.wait_s(arrived) == pytest.approx(answered + 0.2 - arrived)   # b's gather window
    assert q.wait_s(answered + 0.2) == 0.0       # ... and not past it
    # negative control: with b not live, nothing is expected: a goes at once
    live_b = live.pop("b")
    assert q.wait_s(arrived) == 0.0
    live["b"] = live_b
    assert len(q.next_batch(lambda: False)) == 1
    assert time.monotonic() >= answered + 0.2    # next_batch waited for the window
    q.responded("b", 0)
    q.submit("a", request)
    q.submit("b", request)
    assert q.wait_s(q.pending[0].arrived) == 0.0  # every live episode pending: at once
    assert len(q.next_batch(lambda: False)) == 2
    started = time.monotonic()
    live["c"] = (started, 0)                     # c started, no call yet
    q.responded("a", 0)
    q.responded("b", 0)
    q.submit("a", request)
    q.submit("b", request)
    # a and b pending, c expected until max_wait_s after its start, capped by a's own wait
    arrived = q.pending[0].arrived
    assert q.wait_s(arrived) == pytest.approx(min(started, arrived) + 1.0 - arrived, abs=1e-6)
    assert q.wait_s(started + 1.0) == 0.0
    assert len(q.next_batch(lambda: False)) == 2
    assert time.monotonic() >= started + 1.0 - 1e-3   # it waited for c's first call


def test_runner_contains_failures(tok):
    late: list[int] = []
    release = threading.Event()

    def agent(base_url: str, row: dict):
        kind = row["kind"]
        if kind in ("ok", "dict", "slow", "bad", "bad_metrics"):
            two_call_agent(base_url, {"prompt": kind})
        if kind == "raise":
            raise RuntimeError("scaffold exploded")
        if kind == "slow":
            release.wait(30)                      # set once `run` returned
            try:
                client(base_url).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "late"}])
            except openai.APIStatusError as e:
                late.append(e.status_code)
            return 1.0
        return {"ok": 2.5, "dict": {"reward": 1, "metrics": {"tries": 3}}, "none": 0.0,
                "bad": "high", "bad_metrics": {"reward": 1.0, "metrics": {"x": "y"}}}[kind]

    kinds = ["ok", "dict", "raise", "slow", "bad", "none", "bad_metrics"]
    with AgentServer(tok, LIMITS) as server:
        t0 = time.monotonic()
        # 2 s: the two calls of "ok" must fit on a loaded host; "slow" runs past it anyway
        outcomes = AgentRunner(server, agent, "tests:agent", None, 2.0).run(
            ScriptedBackend(tok), [{"kind": k} for k in kinds], list(range(7)))
        release.set()                               # the run did not wait for the slow one
        while not late and time.monotonic() - t0 < 10:
            time.sleep(0.05)
    by = dict(zip(kinds, outcomes))
    assert by["ok"].reward == 2.5 and by["ok"].error is None
    assert by["dict"].reward == 1.0 and by["dict"].metrics == {"tries": 3.0}
    assert "tests:agent raised RuntimeError: scaffold exploded" in by["raise"].error
    assert "ran past its timeout of 2 s" in by["slow"].error
    assert len(by["slow"].trajectories) == 1          # what it made before is kept
    assert "returned 'high'" in by["bad"].error and "tests:agent" in by["bad"].error
    assert "made no call" in by["none"].error and not by["none"].trajectories
    assert "metrics" in by["bad_metrics"].error
    assert all(o.reward == 0.0 for o in outcomes if o.error)
    assert late == [410]                              # its later call was refused


@pytest.mark.parametrize("path", ["gather", "steps"])
def test_a_backend_failure_is_the_runs(tok, path):
    """The engines failing is not a scaffold's failure: the call gets 503 and `run` raises,
    on the gather path (a generate call raises) and on the step path (an engine step
    raises)."""
    class Broken(ScriptedBackend):
        def generate(self, requests):
            raise RuntimeError("engine died")

    class BrokenDriver(ScriptedDriver):
        def step(self):
            raise RuntimeError("engine died")

    backend = Broken(tok) if path == "gather" else StepBackend(BrokenDriver(tok))
    statuses = []

    def agent(base_url, row):
        try:
            client(base_url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}])
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
        return 0.0

    with AgentServer(tok, LIMITS) as server:
        with pytest.raises(RuntimeError, match="engine died"):
            AgentRunner(server, agent, "tests:agent", None, 10).run(backend, [{}], [0])
        t0 = time.monotonic()
        while not statuses and time.monotonic() - t0 < 10:
            time.sleep(0.02)
    assert statuses == [503]


def test_request_checks():
    """parse_chat / parse_completion alone: the limits, serving outside training, refusals."""
    user = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    call = parse_chat({"messages": user, "max_completion_tokens": 10 ** 6}, LIMITS)
    assert call.messages[0]["content"] == "ab" and call.max_tokens == LIMITS.max_new_tokens
    free = Limits(max_new_tokens=8, seq_length=64, temperature=1.0, top_p=1.0,
                  fixed_sampling=False)
    call = parse_chat({"messages": user, "temperature": 0, "top_p": 0.5, "seed": 3}, free)
    assert (call.temperature, call.top_p) == (0.0, 0.5)
    refused = [
        (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "only text"),
        (parse_chat, {"messages": user, "tool_choice": "required"}, "tool_choice"),
        (parse_chat, {"messages": user, "temperature": 3}, "out of range"),
        (parse_chat, {"messages": user, "stream": True}, "streaming is not served"),
        (parse_chat, {"messages": []}, "non-empty list"),
        (parse_completion, {"prompt": "x", "logprobs": 1}, "logprobs=0"),
        (parse_completion, {"prompt": ["a", "b"]}, "one prompt per call"),
        (parse_completion, {"prompt": "x", "tools": []}, "unsupported parameter 'tools'")]
    for parse, body, words in refused:
        with pytest.raises(ApiError, match=words) as e:
            parse(body, free)
        assert e.value.status == 400
    # serve's evaluation parameters: the agent endpoint refuses each saying why (its replies
    # are training samples); Limits(evaluation=True) (serve) accepts the same bodies
    serve_only = [
        (parse_completion, {"prompt": "x", "echo": True}, "echo", "training sample"),
        (parse_chat, {"messages": user, "stream": True}, "stream", "recorded whole"),
        (parse_completion, {"prompt": "x", "stream": True}, "stream", "recorded whole"),
        (parse_chat, {"messages": user, "logprobs": True, "top_logprobs": 2}, "top_logprobs",
         "what training uses"),
        (parse_completion, {"prompt": "x", "logprobs": 2}, "logprobs", "what training uses"),
        (parse_completion, {"prompt": "x", "echo": True, "max_tokens": 0}, "echo",
         "training sample"),
        (parse_completion, {"prompt": "x", "max_tokens": 0}, "max_tokens", "samples a reply"),
        (parse_completion, {"prompt": [[1], [2]]}, "prompt", "extends one trajectory")]
    evaluation = Limits(**{**free.__dict__, "evaluation": True})
    for parse, body, param, why in serve_only:
        with pytest.raises(ApiError, match=why) as e:
            parse(body, free)
        assert e.value.param == param and "megatron-sft-engine serve" in e.value.message
        if param != "max_tokens":            # max_tokens 0 needs echo in serve as well
            parse(body, evaluation)


def test_check_result_contract():
    assert check_result(3, "f") == (3.0, {})
    for bad in (True, float("nan"), None, {"reward": 1, "extra": 2}, [1.0]):
        with pytest.raises(ValueError, match="agent f returned"):
            check_result(bad, "f")


# ----------------------------------------------------------------------------- a real engine

def test_hf_engine_trains_exactly_what_the_client_received(tok, tmp_path):
    """SamplingBackend over the HF rollout engine of a tiny model: the trajectory's sampled ids
    are the ids the client received, and its rollout log-probs are the model's own log-probs of
    those ids in that context (recomputed on the whole trajectory)."""
    from engine.generation.hf.backend import HFRolloutEngine
    from tools.tiny_models import build_tiny_model

    tok.save_pretrained(tmp_path)
    build_tiny_model(str(tmp_path), "qwen3", vocab_size=len(tok), hidden=32, layers=1, heads=2,
                     kv_heads=1, intermediate=64, seed=0, tokenizer=False,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = HFRolloutEngine(str(tmp_path), device="cpu", dtype=torch.float32)
    backend = SamplingBackend(engine.generate)
    limits = Limits(max_new_tokens=12, seq_length=200, temperature=1.0, top_p=1.0)
    with serving(tok, backend, limits) as server:
        ep = server.open_episode(seed=99)
        c = client(server.base_url(ep.id))
        messages = [{"role": "user", "content": "hello"}]
        got = []
        for turn in range(2):
            r = c.chat.completions.create(model="m", messages=messages, logprobs=True,
                                          extra_body={"return_token_ids": True})
            got.append(r.choices[0].token_ids)
            messages += [r.choices[0].message, {"role": "user", "content": f"turn {turn}"}]
        (t,) = ep.trajectories()
    assert [x for x, m in zip(t.token_ids, t.loss_mask) if m] == got[0] + got[1]
    with torch.no_grad():
        logits = engine.model(torch.tensor([t.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
    ref = logp[:, 0][mask]
    rollout = torch.tensor(t.rollout_logprobs[1:])[mask]
    assert torch.allclose(rollout, ref, atol=1e-5), (rollout - ref).abs().max()


# ------------------------------------------------------------ queue bound, stopping, log

def test_a_full_queue_gets_429_and_stop_answers_503_at_once(tok):
    """max_pending=1 and no engine thread: a call waits in the queue; another episode's call
    gets 429 (code queue_full, Retry-After) at once and takes no call index of its episode
    (the next call there is index 0); stop() answers the waiting call 503 and returns well
    under 1 s. Negative control: unbounded (the default), the second call is queued too."""
    user = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}
    for bound in (1, None):
        server = AgentServer(tok, LIMITS, max_pending=bound).start()
        a, b = server.open_episode(seed=1), server.open_episode(seed=2)
        got: dict[str, httpx.Response] = {}

        def send(eid: str) -> threading.Thread:
            return send_call(server, got, eid, user)

        threads = [send(a.id)]
        deadline = time.monotonic() + 10
        while len(server.queue.pending) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        if bound == 1:
            full = httpx.post(server.base_url(b.id) + "/chat/completions", json=user)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full" and b.calls == 0
        else:
            threads.append(send(b.id))
            while len(server.queue.pending) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(server.queue.pending) == 2
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < 1.0
        for t in threads:
            t.join(timeout=10)
        assert all(r.status_code == 503 and r.json()["error"]["code"] == "server_stopping"
                   for r in got.values()) and len(got) == len(threads), got


def test_request_log_is_off_by_default_and_one_line_per_call_when_given(tok, caplog):
    """AgentServer(request_log=logger) logs one INFO line per request (route, status, the
    reply's tokens, milliseconds; a refused call its status and message); without it (the
    default) nothing is logged."""
    import logging

    user = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}

    def logged(name: str | None) -> list[str]:
        return [r.getMessage() for r in caplog.records if "/episodes/" in r.getMessage()
                and r.name != "httpx" and name in (None, r.name)]

    with caplog.at_level(logging.INFO):
        for logger in (None, logging.getLogger("tests.agent_requests")):
            with serving(tok, ScriptedBackend(tok), request_log=logger) as server:
                url = server.base_url(server.open_episode(seed=1).id) + "/chat/completions"
                usage = httpx.post(url, json=user).json()["usage"]
                assert httpx.post(url, json={**user, "n": 0}).status_code == 400
                deadline = time.monotonic() + 5
                while logger and len(logged(logger.name)) < 2 and \
                        time.monotonic() < deadline:
                    time.sleep(0.01)
    lines = logged(None)   # any logger's lines about episodes, but the client's (httpx)
    assert len(lines) == 2 and lines == logged("tests.agent_requests"), lines
    path = url.split(":", 2)[2].split("/", 1)[1]
    assert lines[0].startswith(f"POST /{path} 200 prompt_tokens={usage['prompt_tokens']} "
                               f"completion_tokens={usage['completion_tokens']} ")
    assert lines[1].startswith(f"POST /{path} 400 ") and "n=0" in lines[1]
