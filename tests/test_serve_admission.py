"""What one `serve` request may ask before it is queued (engine.serve.admission), in process on
the word-level tokenizer with a scripted backend (tests/serve_fakes.py): a request's choices
(prompts x n) count against --max-queue and are capped per request (400 naming the flag);
tokenization runs off the event loop (/health answers meanwhile); scoring memory is refused up
front naming --max-score-gib; the one context-budget rule (engine.api.budget) both servers use;
the API key from MEGATRON_SFT_ENGINE_API_KEY."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.api.requests import ApiError, Limits, parse_completion
from engine.serve import __main__ as serve_cli
from engine.serve.endpoint import ServeSettings
from tests.serve_fakes import MAX_CONTEXT, MAX_TOKENS, ScriptedBackend, serving
from tools.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("serve_tok")), 200)


def _wait_pending(endpoint, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(endpoint.queue.pending) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(endpoint.queue.pending) == count


def test_choices_count_against_the_queue_and_are_capped_per_request(tok):
    """--max-queue 4 with the engine blocked: one request in the call, one of 3 prompts queued
    (3 choices wait); a request of 2 choices (3 + 2 > 4) gets 429 at once, though fewer than 4
    requests wait; a request of 3 prompts x n=2 = 6 choices is a 400 naming --max-choices (it
    could never be queued); and on a default endpoint the issue's 1,000,000 prompts x n=8 is a
    400 in well under the seconds tokenizing them would take, nothing queued."""
    backend = ScriptedBackend(blocked=True)
    with serving(tok, backend, max_pending=4) as endpoint:
        url = f"{endpoint.base_url}/completions"
        got = {}

        def send(name, body):
            t = threading.Thread(target=lambda: got.__setitem__(
                name, httpx.post(url, json=body, timeout=30)), daemon=True)
            t.start()
            return t

        first = send("first", {"prompt": "w1", "max_tokens": 1})
        assert backend.started.wait(10)
        queued = send("queued", {"prompt": ["w1", "w2", "w3"], "max_tokens": 1})
        _wait_pending(endpoint, 3)
        full = httpx.post(url, json={"prompt": "w4", "n": 2, "max_tokens": 1}, timeout=10)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert "3 choices (prompts x n) wait for the engine (at most 4, --max-queue)" in \
            full.json()["error"]["message"]   # issue 82 defect 9: it counts choices
        many = httpx.post(url, json={"prompt": ["w1", "w2", "w3"], "n": 2}, timeout=10)
        assert many.status_code == 400, many.text
        error = many.json()["error"]
        assert error["code"] == "too_many_choices" and error["param"] == "prompt"
        assert "6 choices (3 prompts x n=2)" in error["message"]
        assert "at most 4 per request (--max-choices" in error["message"]
        backend.release.set()
        for t in (first, queued):
            t.join(timeout=10)
        assert got["queued"].status_code == 200 and len(got["queued"].json()["choices"]) == 3
        assert len(endpoint.queue.pending) == 0

    with serving(tok, ScriptedBackend()) as endpoint:
        t0 = time.monotonic()
        huge = httpx.post(f"{endpoint.base_url}/completions",
                          json={"prompt": ["a"] * 1_000_000, "n": 8}, timeout=20)
        took = time.monotonic() - t0
        assert huge.status_code == 400, huge.text[:300]
        assert "8000000 choices (1000000 prompts x n=8)" in huge.json()["error"]["message"]
        assert "at most 256 per request" in huge.json()["error"]["message"]
        assert took < 5.0, took
        assert endpoint._accepted == 0


class _HeldTokenizer:
    """`tok` whose encode waits for `release` (after setting `entered`)."""

    def __init__(self, tok) -> None:
        self.tok, self.entered, self.release = tok, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, *args, **kw):
        self.entered.set()
        self.release.wait(10)
        return self.tok.encode(*args, **kw)


def test_health_answers_while_a_request_is_tokenized(tok):
    """A completions request, then a /tokenize request, whose tokenization is held (the
    tokenizer's encode blocked on an event): GET /health answers 200 meanwhile (bodies are
    parsed and tokenized on a worker thread, not the server's event loop); released, the
    request is answered 200."""
    with serving(tok, ScriptedBackend()) as endpoint:
        root = endpoint.base_url[:-len("/v1")]
        for url, body in ((f"{endpoint.base_url}/completions", {"prompt": "w1",
                                                               "max_tokens": 2}),
                          (f"{root}/tokenize", {"prompt": "w1"})):
            held = endpoint.rules.tokenizer = _HeldTokenizer(tok)
            got = {}
            t = threading.Thread(target=lambda: got.__setitem__("r", httpx.post(
                url, json=body, timeout=30)), daemon=True)
            t.start()
            assert held.entered.wait(10)
            try:
                assert httpx.get(f"{root}/health", timeout=2).status_code == 200
            finally:
                held.release.set()
                endpoint.rules.tokenizer = tok
            t.join(timeout=10)
            assert got["r"].status_code == 200, got["r"].text


def test_scoring_memory_is_refused_up_front_naming_the_limit(tok):
    """A scored request (echo + logprobs) whose prompt plus max_tokens needs more float32
    log-probs than --max-score-gib is a 400 (code scoring_too_large) naming the flag and the
    most tokens allowed, before anything is queued; the same prompt without log-probs is
    served. The issue's case: 32,768 tokens on Qwen's 151,936 ids is 18.5 GiB, over the hf
    default of 4 GiB (7067 tokens at most); the vllm backend has no default limit."""
    from engine.serve.admission import check_scoring

    # 20 prompt tokens + 4 = 24 tokens x 200 ids x 4 bytes = 19,200 bytes; limit 10,000 bytes
    settings = ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT, max_score_gib=10_000 / 2 ** 30)
    backend = ScriptedBackend()
    with serving(tok, backend, settings) as endpoint:
        prompt = list(range(60, 80))                    # 20 token ids
        url = f"{endpoint.base_url}/completions"
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 4, "echo": True,
                                  "logprobs": 1}, timeout=10)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "scoring_too_large" and error["param"] == "prompt"
        assert "over 24 tokens (prompt plus max_tokens) on a vocabulary of 200" in \
            error["message"]
        assert "(--max-score-gib; at most 12 tokens per scored sequence)" in error["message"]
        assert backend.calls == [] and endpoint._accepted == 0
        assert httpx.post(url, json={"prompt": prompt, "max_tokens": 4},
                          timeout=10).status_code == 200
    call = SimpleNamespace(logprobs=True, kind="completion")
    with pytest.raises(ApiError) as err:
        check_scoring(call, 32768, "", 151936, 4.0)
    assert "18.5 GiB" in err.value.message and "at most 7067 tokens" in err.value.message
    check_scoring(call, 7067, "", 151936, 4.0)           # the most that fits
    for backend_name, expected in (("hf", 4.0), ("vllm", float("inf"))):
        args = serve_cli.parser("serve").parse_args(["--model", "m", "--backend", backend_name])
        serve_cli.fill_defaults(args, {})
        assert args.max_score_gib == expected and args.max_choices == 256


def test_one_context_budget_rule_for_both_servers():
    """engine.api.budget.reply_budget is the rule of both servers: in the agent's trajectory
    window and serve's --max-context window it gives the same budgets and the messages each
    server's tests expect."""
    from engine.api.budget import Window, reply_budget

    agent = Window(9, "this call's context", "tokens",
                   "a trajectory holds at most 9 (train.seq_length + 1)", "messages")
    assert reply_budget(agent, 5, None, None, 3) == 3
    assert reply_budget(agent, 5, 4, 4, 8) == 4
    assert reply_budget(agent, 8, None, None, 3) == 1
    with pytest.raises(ApiError) as err:
        reply_budget(agent, 6, 4, 4, 8)
    assert err.value.message == ("context length exceeded: this call's context has 6 tokens "
                                 "plus max_tokens=4; a trajectory holds at most 9 "
                                 "(train.seq_length + 1)")
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    serve = Window(199, "this request (prompt 1)", "prompt tokens",
                   "this endpoint serves at most 199 tokens (max_context - 1 with log-probs) "
                   "(--max-context 200)", "prompt")
    assert reply_budget(serve, 199, 0, 0, 12) == 0           # echo, max_tokens 0: scored only
    with pytest.raises(ApiError) as err:
        reply_budget(serve, 199, None, None, 12)
    assert err.value.message == ("context length exceeded: this request (prompt 1) has 199 "
                                 "prompt tokens; this endpoint serves at most 199 tokens "
                                 "(max_context - 1 with log-probs) (--max-context 200)")
    limits = Limits(max_new_tokens=12, seq_length=199, temperature=1.0, top_p=1.0,
                    fixed_sampling=False, evaluation=True)
    call = parse_completion({"prompt": "w1", "max_tokens": 100}, limits)   # capped at 12
    assert call.max_tokens == 12 and reply_budget(serve, 3, 100, call.max_tokens, 12) == 12
    with pytest.raises(ApiError, match="has 3 prompt tokens plus max_tokens=500; "):
        reply_budget(serve, 3, 500, 12, 12)       # as sent, over the room: 400 (as vLLM)


def test_api_key_from_the_environment(tok, monkeypatch, tmp_path, capsys):
    """MEGATRON_SFT_ENGINE_API_KEY sets the key when --api-key is not given (the flag wins);
    VLLM_API_KEY is not read; an empty variable exits 2 naming it. The key it sets guards the
    endpoint: 401 without it, 200 with it."""
    parse = serve_cli.parser("serve").parse_args
    env = {"MEGATRON_SFT_ENGINE_API_KEY": "k3y-from-env", "VLLM_API_KEY": "other"}
    for argv, environ, key in ((["--model", "m"], env, "k3y-from-env"),
                               (["--model", "m", "--api-key", "flag"], env, "flag"),
                               (["--model", "m"], {"VLLM_API_KEY": "other"}, None)):
        args = parse(argv)
        serve_cli.fill_defaults(args, environ)
        assert args.api_key == key, (argv, environ)
    args = parse(["--model", "m"])
    serve_cli.fill_defaults(args, {"MEGATRON_SFT_ENGINE_API_KEY": ""})
    assert serve_cli.flag_problems(args) == [
        "MEGATRON_SFT_ENGINE_API_KEY must be a non-empty key without spaces"]
    monkeypatch.setenv("MEGATRON_SFT_ENGINE_API_KEY", " ")
    assert serve_cli.main(["--model", str(tmp_path)]) == 2
    assert "MEGATRON_SFT_ENGINE_API_KEY must be a non-empty key" in capsys.readouterr().err

    seen = {}

    def serve_model(args) -> int:
        seen["args"] = args
        return 0

    monkeypatch.setenv("MEGATRON_SFT_ENGINE_API_KEY", "k3y-from-env")
    monkeypatch.setattr(serve_cli, "settled", lambda args: None)
    monkeypatch.setattr("engine.serve.run.serve_model", serve_model)
    assert serve_cli.main(["--model", str(tmp_path)]) == 0
    assert seen["args"].api_key == "k3y-from-env"
    with serving(tok, ScriptedBackend(), api_key=seen["args"].api_key) as endpoint:
        url = f"{endpoint.base_url}/completions"
        body = {"prompt": "w1", "max_tokens": 1}
        assert httpx.post(url, json=body, timeout=10).status_code == 401
        assert httpx.post(url, json=body, timeout=10, headers={
            "Authorization": "Bearer k3y-from-env"}).status_code == 200


def test_max_tokens_is_capped_before_the_context_check_and_413_names_its_flag(tok):
    """Issue 82 defect 9 (each fails on the old code): max_tokens=100000 is served with
    --max-tokens (12 here; the old code answered 400 context_length_exceeded), and a prompt
    with no room for the capped 12 is still a 400 naming max_tokens=12; a body over
    --max-body-mb is a 413 whose message names the flag and its value."""
    backend = ScriptedBackend()
    with serving(tok, backend, max_body_bytes=2000) as endpoint:
        url = f"{endpoint.base_url}/completions"
        r = httpx.post(url, json={"prompt": [60, 61], "max_tokens": 100000}, timeout=10)
        assert r.status_code == 200, r.text
        assert [q.max_tokens for q in backend.requests] == [MAX_TOKENS]
        long = [60 + i % 100 for i in range(MAX_CONTEXT - 5)]   # room for 5 tokens only
        r = httpx.post(url, json={"prompt": long, "max_tokens": 100000}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert f"plus max_tokens={MAX_TOKENS};" in r.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": "w1 " * 1000}, timeout=10)
        assert r.status_code == 413
        assert r.json()["error"]["message"].endswith(
            "limit of 2000 bytes (--max-body-mb 0.00190735)"), r.text


def test_dtype_auto_reads_the_weights_as_transformers_does(tmp_path):
    """--dtype auto without a dtype in config.json: the first floating tensor by name, as
    transformers' get_state_dict_dtype reads safetensors' sorted keys, so vLLM is told the
    dtype the hf backend loads. A bfloat16 checkpoint holding a float32 buffer (written first
    in the safetensors header, where float32 tensors come first) is bfloat16; the previous
    code, reading the header's order, said float32. A sharded folder: its index's first shard
    by name."""
    import json as json_
    import torch
    from safetensors.torch import save_file
    from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

    from engine.serve.folder import checkpoint_dtype

    (tmp_path / "config.json").write_text(json_.dumps({"model_type": "llama"}))
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
               "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(4),
               "model.norm.weight": torch.zeros(2, dtype=torch.bfloat16)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = json_.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert next(iter(header)) == "model.layers.0.mlp.gate.e_score_correction_bias"
    loaded = get_state_dict_dtype(load_state_dict(str(tmp_path / "model.safetensors"),
                                                  map_location="meta"))
    assert loaded == torch.bfloat16 and checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "model.safetensors").unlink()
    save_file({"b.weight": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a.weight": torch.zeros(2, dtype=torch.float16)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json_.dumps({"weight_map": {
        "b.weight": "model-00002-of-00002.safetensors",
        "a.weight": "model-00001-of-00002.safetensors"}}))
    assert checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text(json_.dumps({"model_type": "llama",
                                                       "torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "float32"     # config.json's dtype wins


def test_max_n_is_a_flag_named_in_its_refusal(tok, capsys):
    """n per request is bounded by --max-n (default 8), not a fixed 8: over HTTP, n=16 on a
    default endpoint is a 400 (param n) naming --max-n 8, and with max_n 16 (pass@16) it is
    served with 16 choices; the flag is refused below 1 and above --max-choices (exit 2,
    naming it). Fails on the previous code (n above 8 was refused whatever the flags)."""
    body = {"prompt": "w1", "n": 16, "max_tokens": 1}
    with serving(tok, ScriptedBackend()) as endpoint:
        r = httpx.post(f"{endpoint.base_url}/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert r.json()["error"]["message"] == "n=16 must be an integer in [1, 8] (--max-n 8)"
    settings = ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT, max_n=16)
    with serving(tok, ScriptedBackend(), settings) as endpoint:
        r = httpx.post(f"{endpoint.base_url}/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(16))
    parse = serve_cli.parser("serve").parse_args
    for argv, default in ((["--model", "m"], 8), (["--model", "m", "--max-queue", "4"], 4)):
        args = parse(argv)   # the default never exceeds --max-choices (--max-queue's)
        serve_cli.fill_defaults(args, {})
        assert args.max_n == default and serve_cli.flag_problems(args) == [], argv
    assert parse(["--model", "m", "--max-n", "16"]).max_n == 16
    for argv, problem in ((["--max-n", "0"], "--max-n 0 must be in [1, --max-choices 256]"),
                          (["--max-n", "300"], "--max-n 300 must be in [1, --max-choices 256]"),
                          (["--max-n", "5", "--max-choices", "4"],
                           "--max-n 5 must be in [1, --max-choices 4]")):
        args = parse(["--model", "m", *argv])
        serve_cli.fill_defaults(args, {})
        assert serve_cli.flag_problems(args) == [problem], argv
