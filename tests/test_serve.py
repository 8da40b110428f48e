"""`megatron-sft-engine serve` (engine.serve) and the LLM judge (reward.judge.*,
engine.rl.judge) on a tiny locally built model (tools.tiny_models.build_eos_model; nothing is
downloaded): /v1/models, chat and completions through the real `openai` client, greedy replies
equal to the HF rollout engine's own greedy generation token for token, seeds, concurrent
clients in one generate call, 400s; the command line (--help, a bad --model folder, SIGTERM);
the judge's scores equal direct calls (a parser function and a regex), failures scored 0 and
counted (unreachable URL, unparsable reply, timeout); its keys refused by name; the collector
adds reward.fn + a reward model's + the judge's weighted scores before the advantages; one GRPO
step of `python -m engine.rl` judged by a serve endpoint logs reward/judge_mean and dumps
judge_score."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from engine.config.schema import load_config
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.config import RLConfig
from engine.rl.judge.checks import judge_problems
from engine.rl.judge.collector import JudgedCollector, make_collector
from engine.rl.judge.scorer import JudgeScorer, fill
from engine.rl.rewards import math_reward
from engine.generation import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.pool import RolloutPool
from engine.generation.hf.stepper import HFStepDriver
from engine.generation.sampling_backend import SamplingBackend
from engine.serve.__main__ import main as serve_main
from engine.serve.endpoint import ServeEndpoint, ServeSettings
from engine.serve.run import serving_backend
from tests.launch import free_port
from tools.tiny_models import build_eos_model

MAX_TOKENS, MAX_CONTEXT = 12, 200
TEMPLATE = "judge {prompt} then {response} ."


def reply_length(text: str) -> float:
    """A judge parser (reward.judge.parser=tests.test_serve:reply_length)."""
    return float(len(text))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_eos_model(str(tmp_path_factory.mktemp("serve_model") / "llama"))


@pytest.fixture(scope="module")
def served(model_dir):
    """(endpoint, engine): an HF engine served on this process's loopback; the engine is
    owned by the serving thread (the test thread touches it only while nothing is queued)."""
    from engine.serve.model import load_model

    loaded = load_model(model_dir, "hf", "float32", 0, MAX_CONTEXT)
    endpoint = ServeEndpoint(loaded.tokenizer, ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                             gather_s=0.02).start()
    stop = threading.Event()
    backend = serving_backend("hf", loaded.engine, MAX_CONTEXT)   # what serve runs
    assert isinstance(backend.driver, HFStepDriver)
    owner = threading.Thread(target=endpoint.serve, args=(backend, stop.is_set), daemon=True)
    owner.start()
    yield endpoint, loaded.engine, loaded.tokenizer
    stop.set()
    owner.join(timeout=10)
    endpoint.stop()


def _client(endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0)


def _greedy(engine, ids: list[int], n: int) -> list[int]:
    (gen,) = engine.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0))
    return list(gen.response_ids)


def test_models_chat_completions_and_greedy_equal_the_engine(served):
    """/v1/models; a greedy chat completion through the openai client and a greedy text
    completion are the HF engine's own greedy ids for the same prompt ids, token for token;
    max_tokens over --max-tokens is served with --max-tokens; capped, one that does not fit
    in the context is a 400 (context_length_exceeded); a bad
    temperature is a 400 naming it."""
    endpoint, engine, tok = served
    models = httpx.get(f"{endpoint.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    client = _client(endpoint)
    messages = [{"role": "user", "content": "what is 2 plus 3 ?"}]
    reply = client.chat.completions.create(model="anything", messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS,
                                           extra_body={"return_token_ids": True})
    got = reply.model_dump()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert got["prompt_token_ids"] == prompt
    ids = got["choices"][0]["token_ids"]
    assert ids == _greedy(engine, prompt, MAX_TOKENS) and len(ids) >= 1
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(ids)

    text = client.completions.create(model="tiny", prompt="w12 w40 w7", temperature=0,
                                     max_tokens=5, extra_body={"return_token_ids": True})
    body = text.model_dump()
    assert body["choices"][0]["token_ids"] == _greedy(engine, body["prompt_token_ids"], 5)

    served_capped = client.chat.completions.create(   # over --max-tokens: served with it
        model="tiny", messages=messages, max_tokens=MAX_CONTEXT, temperature=0)
    assert served_capped.choices[0].message.content == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:   # the capped 12 do not fit
        client.completions.create(model="tiny", prompt=[60] * (MAX_CONTEXT - 5),
                                  max_tokens=MAX_CONTEXT)
    assert err.value.code == "context_length_exceeded" and "--max-context" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, temperature=3)
    assert "temperature" in str(err.value)


def _post(endpoint, body: dict) -> dict:
    response = httpx.post(f"{endpoint.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_concurrent_clients_run_in_the_step_driver_and_seeds_decide(served):
    """Four clients at once, on the step path serve runs (engine.generation.hf.stepper: who
    shares which step is tested there): no generate call of the engine; a seeded request's
    reply is the same alone and beside the others, another seed gives another sample;
    malformed JSON is a 400."""
    endpoint, engine, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count w1 w2 w3"}],
            "temperature": 1.0, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    alone = _post(endpoint, {**body, "seed": 7})["choices"][0]["token_ids"]
    seeds = [7, 8, 9, 10]
    out: dict[int, list[int]] = {}
    barrier = threading.Barrier(len(seeds))

    def client(seed: int) -> None:
        barrier.wait()
        out[seed] = _post(endpoint, {**body, "seed": seed})["choices"][0]["token_ids"]

    calls = engine.num_generate_calls
    endpoint.queue.gather_s = 0.5   # a wide window: the four threads start on a busy host
    threads = [threading.Thread(target=client, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    endpoint.queue.gather_s = 0.02
    assert engine.num_generate_calls == calls
    assert out[7] == alone
    assert len({tuple(v) for v in out.values()}) > 1
    bad = httpx.post(f"{endpoint.base_url}/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


def test_command_line_help_bad_folders_and_sigterm(model_dir, tmp_path, capsys):
    """`serve --help`; a missing folder, one without config.json and one without a tokenizer
    exit 2 naming --model; a real serve with --api-key on the main thread answers the openai
    client sending the key, 401 without it (/tokenize too), 413 over --max-body-mb, logs one
    line per request on stdout (no --quiet), and exits 0 on SIGTERM."""
    with pytest.raises(SystemExit) as e:
        serve_main(["--help"], prog="megatron-sft-engine serve")
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--backend {hf,vllm}" in out
    assert "--max-queue N" in out and "--quiet" in out and "/tokenize" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model_dir, name), no_tok / name)
    for folder, expected in ((tmp_path / "nope", "is not a directory"),
                             (empty, "has no config.json"), (no_tok, "has no tokenizer")):
        assert serve_main(["--model", str(folder)]) == 2
        assert f"--model {str(folder)!r} {expected}" in capsys.readouterr().err
    assert serve_main(["--model", model_dir, "--top-p", "0"]) == 2
    assert "--top-p 0.0 must be in (0, 1]" in capsys.readouterr().err
    assert serve_main(["--model", model_dir, "--api-key", "a b"]) == 2
    assert "--api-key must be a non-empty key without spaces" in capsys.readouterr().err
    assert serve_main(["--model", model_dir, "--max-body-mb", "0"]) == 2
    assert "--max-body-mb 0.0 must be a finite size" in capsys.readouterr().err
    assert serve_main(["--model", model_dir, "--max-queue", "0"]) == 2
    assert "--max-queue 0 must be >= 1" in capsys.readouterr().err

    port, seen = free_port(), {}

    def client() -> None:
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    httpx.get(f"{url}/health")
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            chat = dict(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            seen["bare"] = httpx.post(f"{url}/v1/chat/completions", json=chat)
            seen["tokenize"] = [httpx.post(f"{url}/tokenize", json={"prompt": "hi"},
                                           headers=h).status_code
                                for h in ({}, {"Authorization": "Bearer k3y"})]
            seen["big"] = httpx.post(f"{url}/v1/chat/completions", headers={
                "Authorization": "Bearer k3y"}, json={**chat, "user": "u" * 2000})
            with pytest.raises(openai.AuthenticationError):       # another key: 401
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0
                              ).models.list()
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
            seen["reply"] = c.chat.completions.create(**chat)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=client, daemon=True)
    helper.start()
    code = serve_main(["--model", model_dir, "--port", str(port), "--max-tokens", "8",
                       "--dtype", "float32", "--batch-wait-ms", "1", "--api-key", "k3y",
                       "--max-body-mb", "0.001", "--max-queue", "4"])
    helper.join(timeout=30)
    out = capsys.readouterr().out
    assert code == 0 and "[serve] stopped" in out and f"127.0.0.1:{port}/v1" in out
    # --api-key: /health stayed open (the wait above), a request without the key got 401
    # (the keyless `served` fixture answers the other tests' clients: open by default)
    assert seen["bare"].status_code == 401, seen["bare"].text
    assert seen["bare"].json()["error"]["code"] == "invalid_api_key"
    # --max-body-mb 0.001 (1048 bytes): a 2 kB body is a 413, the chat above was served
    assert seen["big"].status_code == 413 and "1048 bytes" in seen["big"].text
    assert seen["reply"].model == "llama" and len(seen["reply"].choices) == 1
    assert seen["tokenize"] == [401, 200]
    # one request line each on stdout: the 401s, the 413 and the served chat with its tokens
    lines = [x for x in out.splitlines() if re.match(r"\[serve\] \S+ \S+ (GET|POST) ", x)]
    assert len(lines) == 7, lines      # /health, chat 401, 2 x /tokenize, 413, models 401, chat
    assert re.search(r"POST /v1/chat/completions 401 \d+\.\d ms: Incorrect API key", out)
    assert re.search(r"POST /v1/chat/completions 413 \d+\.\d ms: the request body", out)
    usage = seen["reply"].usage
    assert f"POST /v1/chat/completions 200 prompt_tokens={usage.prompt_tokens} " \
        f"completion_tokens={usage.completion_tokens} " in out


# ------------------------------------------------------------------------------- the judge

def _judge_config(argv: list[str]):
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def _direct(endpoint, prompt: str, response: str) -> str:
    """The judge's reply text from a direct openai-client call with the scorer's request."""
    reply = _client(endpoint).chat.completions.create(
        model="judge", temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": fill(TEMPLATE, prompt, response)}])
    return reply.choices[0].message.content


ITEMS = [("what is 1 plus 2 ?", "w12 w7 3"), ("say w40", "w40 w41"), ("{response}", "x")]


def test_judge_scores_equal_direct_calls_and_failures_count(served):
    """reward.judge against serve: a parser function and a regex give what direct calls of
    the same request give (a reply the regex misses: 0 and an error); an unreachable URL, an
    unparsable reply and a judge that never answers score 0 and are counted."""
    endpoint = served[0]
    texts = [_direct(endpoint, p, r) for p, r in ITEMS]
    base = [f"reward.judge.base_url={endpoint.base_url}", f"reward.judge.prompt='{TEMPLATE}'",
            f"reward.judge.max_tokens={MAX_TOKENS}", "reward.judge.concurrency=2"]
    cfg = _judge_config(base + ["reward.judge.parser=tests.test_serve:reply_length"])
    assert judge_problems(cfg) == [] and cfg.reward.fn == "none"
    got = JudgeScorer(cfg.reward.judge).score(ITEMS)
    assert got.scores == [float(len(t)) for t in texts] and got.num_errors == 0

    regex = _judge_config(base + ["reward.judge.parser='w(\\d+)'"]).reward.judge
    got = JudgeScorer(regex).score(ITEMS)
    expected = [float(re.findall(r"w(\d+)", t)[-1]) if re.findall(r"w(\d+)", t) else 0.0
                for t in texts]
    assert got.scores == expected
    assert got.num_errors == sum(not re.findall(r"w(\d+)", t) for t in texts)

    never = _judge_config(base + ["reward.judge.parser='(NEVER)'"]).reward.judge
    got = JudgeScorer(never).score(ITEMS)
    assert got.scores == [0.0] * 3 and got.num_errors == 3 and "unparsable" in got.errors[0]

    unreachable = _judge_config(base + [f"reward.judge.base_url=http://127.0.0.1:"
                                        f"{free_port()}/v1"]).reward.judge
    got = JudgeScorer(unreachable).score(ITEMS[:2])
    assert got.scores == [0.0, 0.0] and got.num_errors == 2 and "Connect" in got.errors[0]

    with socket.socket() as silent:   # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        hangs = _judge_config(base + [
            f"reward.judge.base_url=http://127.0.0.1:{silent.getsockname()[1]}/v1",
            "reward.judge.timeout_s=0.3"]).reward.judge
        t0 = time.monotonic()
        got = JudgeScorer(hangs).score(ITEMS[:2])
    assert got.num_errors == 2 and "timeout_s=0.3" in got.errors[0]
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("argv, expected", [
    (["reward.judge.prompt='rate {prompt}'"], "reward.judge.prompt lacks {response}"),
    (["reward.judge.prompt='rate {response}'"], "reward.judge.prompt lacks {prompt}"),
    (["reward.judge.parser='(a)(b)'"], "has 2 groups; a regex needs exactly one"),
    (["reward.judge.parser=tests.test_serve:missing"], "has no attribute 'missing'"),
    (["reward.judge.concurrency=0"], "reward.judge.concurrency=0 must be an integer >= 1"),
    (["reward.judge.timeout_s=0"], "reward.judge.timeout_s=0"),
    (["reward.judge.api_key_env=SERVE_TEST_UNSET_KEY"], "that environment variable is not set"),
    (["reward.judge.base_url=127.0.0.1:8000/v1"], "must be an http:// or https:// URL"),
    (["env.agent=tests.test_serve:reply_length"], "with env.agent is not built")])
def test_judge_keys_are_refused_by_name(argv, expected):
    base = [] if any("base_url" in a for a in argv) else ["reward.judge.base_url=http://h/v1"]
    assert any(expected in p for p in judge_problems(_judge_config(base + argv))), expected


def test_collector_adds_judge_and_reward_model_scores(served, model_dir, tmp_path):
    """reward.fn=math + 0.5 x a reward model's score (a stand-in scorer on the pool) + 0.25 x
    the judge's: the batch's scores and rewards, its GRPO advantages, reward/judge_mean and the
    dump's judge_score; a judge whose replies never parse scores 0 and counts every response
    in reward/errors."""
    endpoint, _, tok = served
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)} for a, b in [(1, 1),
                                                                                     (2, 3)]]
    argv = ["reward.fn=math", "reward.model.weight=0.5", "rollout.n=2",
            "train.prompts_per_step=2", "rollout.max_new_tokens=6", "train.seq_length=96",
            "data.shuffle=false", f"logging.rollout_dir={tmp_path}",
            f"reward.judge.base_url={endpoint.base_url}", "reward.judge.weight=0.25",
            "reward.judge.parser=tests.test_serve:reply_length",
            f"reward.judge.prompt='{TEMPLATE}'", f"reward.judge.max_tokens={MAX_TOKENS}"]
    engine = HFRolloutEngine(model_dir, dtype=torch.float32)   # not the served one's thread
    dumped = None
    for parser, dump in (("tests.test_serve:reply_length", 1), ("'(NEVER)'", None)):
        cfg = _judge_config(argv + [f"reward.judge.parser={parser}"])
        pool = RolloutPool.local(engine, cfg.rollout)
        pool.scorer = lambda ids: [sum(x) / 100 for x in ids]
        collector = make_collector(pool, rows, tok, cfg)
        assert isinstance(collector, JudgedCollector)
        batch = collector.collect(dump_step=dump)
        texts = [(rows[i // 2]["prompt"], tok.decode(r, skip_special_tokens=True))
                 for i, r in enumerate(batch.response_ids)]
        fn = [math_reward(p, r, rows[i // 2]["answer"]) for i, (p, r) in enumerate(texts)]
        rm = [sum(list(p) + list(r)) / 100 for p, r in zip(batch.prompt_ids, batch.response_ids)]
        judge = [float(len(_direct(endpoint, p, r))) if dump else 0.0 for p, r in texts]
        assert batch.scores == pytest.approx([f + 0.5 * m + 0.25 * j
                                              for f, m, j in zip(fn, rm, judge)], rel=1e-6)
        assert batch.rewards == pytest.approx(batch.scores, rel=1e-6)
        lengths = torch.tensor([len(r) for r in batch.response_ids])
        adv = ADVANTAGE_ESTIMATORS["grpo"](torch.tensor(batch.rewards), 2, cfg.advantage,
                                           lengths)
        assert batch.advantages == pytest.approx(adv.tolist(), abs=1e-6)
        assert batch.metrics["reward/judge_mean"] == pytest.approx(sum(judge) / 4, rel=1e-6)
        assert batch.metrics["reward/errors"] == (0 if dump else 4)
        dumped = judge if dump else dumped
    records = [json.loads(x) for x in open(tmp_path / "step_1.jsonl")]
    assert [r["judge_score"] for r in records] == dumped
    assert all("rm_score" in r for r in records)


def test_rl_step_judged_by_serve_logs_judge_mean(served, pools, model_dir, tmp_path):
    """One GRPO step of `python -m engine.rl` (1 process) with reward.fn=math and
    reward.judge at the serve endpoint (weight 0.5): every dumped judge_score is a direct
    judge call's score of (prompt, response text), reward = math + 0.5 x judge_score, and
    reward/judge_mean is their mean; no reward errors."""
    endpoint, _, tok = served
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": a + b} for a, b in [(1, 2), (3, 4)]]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = pools.script(
        1, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{data}]",
        "reward.fn=math", f"reward.judge.base_url={endpoint.base_url}",
        "reward.judge.parser=tests.test_serve:reply_length", "reward.judge.weight=0.5",
        f"reward.judge.prompt='{TEMPLATE}'", f"reward.judge.max_tokens={MAX_TOKENS}",
        "rollout.n=2", "rollout.max_new_tokens=6", "train.prompts_per_step=2",
        "train.micro_batch_size=2", "train.max_steps=1", "train.seq_length=128",
        "data.shuffle=false", f"logging.dir={tmp_path}", "logging.progress_bar=false",
        f"logging.rollout_dir={tmp_path / 'rollouts'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    dump = [json.loads(x) for x in (tmp_path / "rollouts" / "step_1.jsonl").read_text()
            .splitlines()]
    assert len(dump) == 4 and metrics["reward/errors"] == 0
    judged = []
    for record in dump:
        start = record["loss_mask"].index(1)
        response = tok.decode(record["token_ids"][start:], skip_special_tokens=True)
        prompt = rows[record["prompt_index"]]["prompt"]
        direct = float(len(_direct(endpoint, prompt, response)))
        assert record["judge_score"] == direct
        fn = math_reward(prompt, response, str(rows[record["prompt_index"]]["answer"]))
        assert record["reward"] == pytest.approx(fn + 0.5 * direct, rel=1e-6)
        judged.append(direct)
    assert metrics["reward/judge_mean"] == pytest.approx(sum(judged) / len(judged), rel=1e-6)
    assert metrics["reward/mean"] == pytest.approx(
        sum(r["reward"] for r in dump) / len(dump), rel=1e-6)


# ------------------------------------------------------------------ evaluation (issue 68)

def _reference(model, seq: list[int]) -> torch.Tensor:
    """transformers' fp32 log_softmax rows of `seq` ([len, vocab]; row i: after seq[:i+1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits.float(), -1)[0]


def _check_echo_logprobs(tok, model, seq: list[int], lp: dict, k: int) -> float:
    """`lp` (a choice's logprobs over `seq`) against transformers: token_logprobs and the
    top-k; returns the largest gap of the shifted-by-one reference (the negative control)."""
    ref = _reference(model, seq)
    assert lp["tokens"] == [tok.decode([t]) for t in seq]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[i - 1, seq[i]].item() for i in range(1, len(seq))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    for i in range(1, len(seq)):
        values, ids = torch.topk(ref[i - 1], k)
        top = lp["top_logprobs"][i]
        assert set(top) == {tok.decode([t]) for t in [seq[i], *ids.tolist()]}
        for t, v in zip(ids.tolist(), values.tolist()):
            assert top[tok.decode([t])] == pytest.approx(v, abs=1e-5)
    shifted = [ref[i, seq[i]].item() for i in range(1, len(seq))]
    return max(abs(a - b) for a, b in zip(shifted, lp["token_logprobs"][1:]))


def test_echo_logprobs_prompt_lists_and_max_tokens_0_equal_transformers(served, model_dir):
    """/v1/completions with echo and logprobs=3: two id-list prompts with max_tokens 0 (the
    prompts scored, nothing generated) and two text prompts with max_tokens 1 and n=2: the
    choices in prompt-major order with their index, the text the prompt's then the reply's,
    token_logprobs = transformers' fp32 log_softmax gathered (1e-5; the first null), top_logprobs
    = torch.topk of the same rows plus the chosen token; a shifted-by-one reference is off.
    usage sums over the prompts; logprobs over the cap, max_tokens 0 without echo, a mixed
    prompt list are 400s naming the parameter."""
    from transformers import AutoModelForCausalLM

    endpoint, engine, tok = served
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    url = f"{endpoint.base_url}/completions"
    ids = [[1, 17, 40, 9, 33], [1, 5, 6]]
    calls = engine.num_generate_calls
    got = httpx.post(url, json={"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0,
                                "model": "tiny"}, timeout=60).json()
    assert engine.num_generate_calls == calls               # max_tokens 0: nothing generated
    assert [c["index"] for c in got["choices"]] == [0, 1]
    gaps = []
    for c, seq in zip(got["choices"], ids):
        assert c["text"] == tok.decode(seq) and c["finish_reason"] == "length"
        gaps.append(_check_echo_logprobs(tok, model, seq, c["logprobs"], 3))
    assert got["usage"] == {"prompt_tokens": 8, "completion_tokens": 0, "total_tokens": 8}
    assert max(gaps) > 1e-2                                  # negative control

    texts = ["w12 w40 w7", "w3 w3"]
    got = httpx.post(url, json={"prompt": texts, "echo": True, "logprobs": 2, "max_tokens": 1,
                                "n": 2, "seed": 5, "return_token_ids": True},
                     timeout=60).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for index, c in enumerate(got["choices"]):
        prompt = tok(texts[index // 2])["input_ids"]
        assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 1
        whole = tok.decode(prompt + c["token_ids"], skip_special_tokens=True)
        assert c["text"] == texts[index // 2] + whole[len(tok.decode(prompt)):]  # as vLLM
        _check_echo_logprobs(tok, model, prompt + c["token_ids"], c["logprobs"], 2)
    assert got["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in texts)
    assert got["usage"]["completion_tokens"] == 4          # each prompt counted once, n = 2
    for body, param in (({"prompt": "x", "logprobs": 21}, "logprobs"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": ["x", [1, 2]]}, "prompt")):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "cap of 20" in httpx.post(url, json={"prompt": "x", "logprobs": 21}).text


def test_chat_top_logprobs_and_response_format(served):
    """A greedy chat with logprobs and top_logprobs=3: every entry's top-1 is the sampled token
    with its log-prob, three alternatives most likely first; response_format text is served,
    json_object a 400 by name, top_logprobs over the cap a 400."""
    endpoint = served[0]
    client = _client(endpoint)
    messages = [{"role": "user", "content": "count w1 w2"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                           logprobs=True, top_logprobs=3, max_tokens=6,
                                           response_format={"type": "text"})
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens >= 1
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages,
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format" and "json_object" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="cap of 20"):
        client.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                       top_logprobs=21)


def test_streams_equal_the_whole_replies(served):
    """stream=true through the openai client: a seeded chat's concatenated deltas equal the
    non-streamed reply of the same request, its usage chunk (include_usage) the same usage;
    a seeded completion with echo and logprobs likewise (text, tokens and token log-probs);
    the raw stream is text/event-stream ending with data: [DONE]."""
    endpoint = served[0]
    client = _client(endpoint)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "say w5 w9 w2"}],
                max_tokens=MAX_TOKENS, seed=11, temperature=1.0, n=2)
    whole = client.chat.completions.create(**chat)
    parts, usage, finish, deltas = {0: "", 1: ""}, None, {}, 0
    for chunk in client.chat.completions.create(**chat, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            deltas += bool(c.delta.content)
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [parts[k] for k in (0, 1)] == [c.message.content for c in whole.choices]
    assert [finish[k] for k in (0, 1)] == [c.finish_reason for c in whole.choices]
    assert usage.model_dump() == whole.usage.model_dump()
    assert deltas > 2          # per-token deltas, not one piece per choice

    text = dict(model="tiny", prompt="w12 w40 w7", max_tokens=MAX_TOKENS, seed=3, echo=True,
                logprobs=1)
    whole = client.completions.create(**text).choices[0]
    got, tokens, lps = "", [], []
    for chunk in client.completions.create(**text, stream=True):
        for c in chunk.choices:
            got += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert got == whole.text and tokens == whole.logprobs.tokens
    assert lps == whole.logprobs.token_logprobs
    raw = httpx.post(f"{endpoint.base_url}/completions", json={**text, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n") and raw.text.startswith("data: {")


def test_sampling_backend_scores_in_one_call_and_skips_max_tokens_0():
    """SamplingBackend with a score function: requests asking scores (k 1 and 3) are scored in
    ONE call over prompt + sampled ids with the largest k, each cut to its own k; a request
    with max_tokens 0 takes no generate call; one without score_top_k gets no scores (as the
    agent endpoint's)."""
    from engine.api.backend import GenerateRequest
    from engine.generation.base import Generation
    from engine.generation.scoring import SequenceScores

    generated, scored = [], []

    def generate(prompts, params):
        generated.append([list(p) for p in prompts])
        return [Generation(prompt_ids=list(p), response_ids=[7, 8],
                           response_logprobs=[-1.0, -2.0], finish_reason="stop")
                for p in prompts]

    def score(sequences, top_k):
        scored.append((sequences, top_k))
        return [SequenceScores([-0.5] * (len(s) - 1),
                               [{t: -float(t) for t in range(top_k)}] * (len(s) - 1))
                for s in sequences]

    backend = SamplingBackend(generate, score=score)
    out = backend.generate([GenerateRequest((1, 2), 2, 1.0, 1.0, 0, score_top_k=1),
                            GenerateRequest((3,), 0, 1.0, 1.0, 0, score_top_k=3),
                            GenerateRequest((4, 5), 2, 1.0, 1.0, 0)])
    assert generated == [[[1, 2], [4, 5]]] and scored == [([[1, 2, 7, 8], [3]], 3)]
    assert out[0].scores.top == [{0: 0.0}] * 3 and out[0].scores.logprobs == [-0.5] * 3
    assert out[1].ids == [] and out[1].finish_reason == "length" and out[1].scores.top == []
    assert out[2].scores is None and out[2].logprobs == [-1.0, -2.0]


# ------------------------------------------------- tokenizer routes, request log, queue bound

def _root(endpoint) -> str:
    return endpoint.base_url[:-len("/v1")]


def test_tokenizer_routes_equal_the_tokenizer_and_serve_lm_eval(served):
    """/tokenize and /detokenize at the root equal the tokenizer's own encode / decode (a chat
    with the generation prompt: the chat completion's prompt_token_ids; without it: the
    template's ids, which differ); /tokenizer_info carries its special tokens, class and
    template; lm-eval 0.4.13's check_remote_tokenizer_support and RemoteTokenizer work against
    it (a port without a server: False); client.models.retrieve; malformed bodies are 400s
    naming the parameter."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    endpoint, _, tok = served
    root, text = _root(endpoint), "w12 w40 w7 what is 2 plus 3 ?"
    got = httpx.post(f"{root}/tokenize", json={"prompt": text, "return_token_strs": True}
                     ).json()
    ids = tok.encode(text)
    assert got == {"count": len(ids), "max_model_len": MAX_CONTEXT, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    assert httpx.post(f"{root}/tokenize", json={"prompt": text, "add_special_tokens": False}
                      ).json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert httpx.post(f"{root}/detokenize", json={"tokens": ids}).json() == {
        "prompt": tok.decode(ids)}
    messages = [{"role": "user", "content": "what is 2 plus 3 ?"}]
    chat = httpx.post(f"{endpoint.base_url}/chat/completions", json={
        "messages": messages, "max_tokens": 1, "return_token_ids": True}).json()
    prompt = httpx.post(f"{root}/tokenize", json={"messages": messages}).json()["tokens"]
    assert prompt == chat["prompt_token_ids"]
    bare = httpx.post(f"{root}/tokenize", json={"messages": messages,
                                                "add_generation_prompt": False}).json()
    expected = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert bare["tokens"] == expected and expected != prompt
    info = httpx.get(f"{root}/tokenizer_info").json()
    assert info == {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                    "unk_token": tok.unk_token, "model_max_length": tok.model_max_length,
                    "chat_template": tok.chat_template}

    assert check_remote_tokenizer_support(f"{root}/v1/completions", max_retries=1)
    assert not check_remote_tokenizer_support(f"http://127.0.0.1:{free_port()}",
                                              max_retries=1)
    remote = RemoteTokenizer(f"{endpoint.base_url}/completions", max_retries=1)
    for words in ("hello world", text):
        assert remote.encode(words) == tok.encode(words, add_special_tokens=False)
    assert remote.decode(ids) == tok.decode(ids) and remote.eos_token_id == tok.eos_token_id

    client = _client(endpoint)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/other")
    assert err.value.code == "model_not_found" and "'org/other'" in str(err.value)
    for route, body, param in (
            ("tokenize", {"prompt": 1}, "prompt"),
            ("tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
            ("tokenize", {"prompt": "x", "foo": 1}, "foo"),
            ("tokenize", {"messages": [1]}, "messages"),
            ("tokenize", {"messages": messages, "tools": [{"function": 1}]}, "tools"),
            ("detokenize", {"tokens": [-1]}, "tokens"),
            ("detokenize", {"tokens": [len(tok) + 5]}, "tokens"),
            ("detokenize", {"tokens": "w1"}, "tokens")):
        r = httpx.post(f"{root}/{route}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert param in r.json()["error"]["message"], r.text


def _log_lines(caplog, count: int) -> list[str]:
    """The engine.serve records once `count` are there (a line is logged once its response
    went out: the client may see the response first)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if r.name == "engine.serve"]
        if len(lines) >= count:
            return lines
        time.sleep(0.01)
    return lines


def test_one_log_line_per_request_and_none_with_quiet(served, caplog):
    """serve logs one INFO line per request on the "engine.serve" logger: route, status,
    the reply's prompt and completion tokens (the response's usage, or a stream's usage
    chunk), milliseconds; a refused
    request its status and the error's first line. Negative control: an endpoint built with
    request_log=None (--quiet) logs nothing for the same requests (only a marker request to
    the logged endpoint after them is)."""
    import logging

    endpoint, _, tok = served
    body = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="engine.serve"):
        usage = _post(endpoint, body)["usage"]
        bad = httpx.post(f"{endpoint.base_url}/chat/completions", json={**body, "n": 0})
        httpx.get(f"{endpoint.base_url}/models")
        streamed = list(_client(endpoint).chat.completions.create(
            model="tiny", stream=True, stream_options={"include_usage": True}, **body))
        lines = _log_lines(caplog, 4)
    assert len(lines) == 4 and all(r.levelno == logging.INFO for r in caplog.records)
    assert re.fullmatch(rf"POST /v1/chat/completions 200 prompt_tokens="
                        rf"{usage['prompt_tokens']} completion_tokens="
                        rf"{usage['completion_tokens']} \d+\.\d ms", lines[0]), lines[0]
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and re.fullmatch(
        r"POST /v1/chat/completions 400 \d+\.\d ms: " + re.escape(message.splitlines()[0]),
        lines[1]), lines[1]
    assert re.fullmatch(r"GET /v1/models 200 \d+\.\d ms", lines[2]), lines[2]
    usage = streamed[-1].usage      # a stream's tokens: from its include_usage chunk
    assert lines[3].startswith(f"POST /v1/chat/completions 200 prompt_tokens="
                               f"{usage.prompt_tokens} completion_tokens="
                               f"{usage.completion_tokens} "), lines[3]
    caplog.clear()
    quiet = ServeEndpoint(tok, ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                          request_log=None).start()
    try:
        with caplog.at_level(logging.INFO, logger="engine.serve"):
            assert httpx.get(f"{quiet.base_url}/models").status_code == 200
            assert httpx.post(f"{quiet.base_url}/chat/completions", json={**body, "n": 0}
                              ).status_code == 400
            httpx.get(f"{endpoint.base_url}/models")      # a marker from the logged endpoint
            assert len(_log_lines(caplog, 1)) == 1 and \
                _log_lines(caplog, 1)[0].startswith("GET /v1/models 200")
    finally:
        quiet.stop()


class _BlockedBackend:
    """A GenerateBackend whose generate call waits for `release` (one token per request)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def generate(self, requests):
        from engine.api.backend import GenerateResult

        self.started.set()
        self.release.wait(10)
        return [GenerateResult([5], [-0.5], "length") for _ in requests]


def test_a_full_queue_gets_429_and_stopping_answers_503_at_once(served):
    """max_pending=1 with the engine blocked in a generate call: a request in the call, one
    queued, the next gets 429 (code queue_full, Retry-After: 1) at once and takes no request
    number (the unseeded seeds of later requests do not move). Stopping (the
    serving loop's `until`): the call in flight is answered 200, the queued request 503.
    Then stop() with a request queued and no engine: the request gets 503 and stop() returns
    well under 1 s."""
    tok = served[2]
    body = {"prompt": "w1 w2", "max_tokens": 1}
    for phase in ("serving", "stop"):
        endpoint = ServeEndpoint(tok, ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                                 gather_s=0.0, max_pending=1, request_log=None).start()
        url, backend, until = f"{endpoint.base_url}/completions", _BlockedBackend(), \
            threading.Event()
        owner = threading.Thread(target=endpoint.serve, args=(backend, until.is_set),
                                 daemon=True)
        got: dict[str, httpx.Response] = {}

        def send(name: str) -> threading.Thread:
            t = threading.Thread(target=lambda: got.__setitem__(name, httpx.post(
                url, json=body, timeout=30)), daemon=True)
            t.start()
            return t

        try:
            if phase == "serving":
                owner.start()
                first = send("in_flight")
                assert backend.started.wait(10)
            queued = send("queued")
            deadline = time.monotonic() + 10
            while not endpoint.queue.pending and time.monotonic() < deadline:
                time.sleep(0.01)
            full = httpx.post(url, json=body, timeout=30)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full", full.text
            assert endpoint._accepted == (2 if phase == "serving" else 1)   # 429: no number
            if phase == "serving":
                until.set()
                backend.release.set()
                for t in (first, queued):
                    t.join(timeout=10)
                owner.join(timeout=10)
                assert got["in_flight"].status_code == 200, got["in_flight"].text
            else:
                t0 = time.monotonic()
                endpoint.stop()
                assert time.monotonic() - t0 < 1.0
                queued.join(timeout=10)
            assert got["queued"].status_code == 503, got["queued"].text
            assert got["queued"].json()["error"]["code"] == "server_stopping"
        finally:
            backend.release.set()
            endpoint.stop()


@pytest.fixture(scope="module")
def agent_url(served):
    """The chat and completions URLs of one episode of an agent endpoint on the served
    tokenizer (nothing malformed reaches a queue: no engine thread)."""
    from engine.api.requests import Limits
    from engine.rl.agent.server import AgentServer

    limits = Limits(max_new_tokens=MAX_TOKENS, seq_length=MAX_CONTEXT, temperature=1.0,
                    top_p=1.0)
    with AgentServer(served[2], limits) as server:
        yield server.base_url(server.open_episode(seed=0).id)


USER = [{"role": "user", "content": "w1"}]
CALLED = USER + [{"role": "assistant", "content": "", "tool_calls": "TOOL_CALLS"}, *USER]
MALFORMED = [   # (route, body: a dict or raw bytes, param, words the message holds)
    ("chat", {"messages": USER, "tools": [{"function": 1}]}, "tools", "tools[0].function"),
    ("chat", {"messages": USER, "tools": [{"type": "function", "function": {"name": 1}}]},
     "tools", "tools[0].function.name"),
    ("chat", {"messages": USER, "tools": [1]}, "tools", "tools[0]"),
    ("chat", {"messages": USER, "tools": {"a": 1}}, "tools", "'tools'"),
    ("chat", {"messages": [1]}, "messages", "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": [1]}]}, "messages",
     "messages[0].content[0]"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages", "messages[0].content[0].text"),
    ("chat", {"messages": [{"role": "user", "content": {"a": 1}}]}, "messages",
     "messages[0].content"),
    ("chat", {"messages": [{"role": 1, "content": "w1"}]}, "messages", "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "w1", "name": 1}]}, "messages",
     "messages[0].name"),
    ("chat", 1, "messages", "messages[1].tool_calls"),
    ("chat", [1], "messages", "messages[1].tool_calls[0]"),
    ("chat", [{"function": 1}], "messages", "messages[1].tool_calls[0].function"),
    ("chat", [{"function": {"name": 1}}], "messages", "tool_calls[0].function.name"),
    ("chat", [{"function": {"name": "f", "arguments": 1}}], "messages",
     "tool_calls[0].function.arguments"),
    ("chat", [{"id": 1, "function": {"name": "f"}}], "messages", "tool_calls[0].id"),
    ("chat", {"messages": USER, "stop": [1]}, "stop", "stop"),
    ("chat", {"messages": USER, "stop": {"a": 1}}, "stop", "stop"),
    ("chat", {"messages": USER, "tool_choice": [1]}, "tool_choice", "tool_choice"),
    ("completions", {"prompt": [None]}, "prompt", "prompt"),
    ("completions", {"prompt": {"a": 1}}, "prompt", "prompt"),
    ("completions", {"prompt": [1, "w1"]}, "prompt", "prompt"),
    ("chat", b"[" * 100000 + b"]" * 100000, None, "nests deeper than 64 levels"),
    ("chat", b'{"messages": [{"role": "user", "content": "w1", "x": ' + b"[" * 900
     + b"]" * 900 + b"}]}", None, "nests deeper than 64 levels"),
    ("chat", b'{"messages": [], "seed": ' + b"7" * 5000 + b"}", None,
     "an integer of 5000 digits"),
    ("chat", b'{"messages": [{"role": "user", "content": "w1"}], "temperature": NaN}', None,
     "NaN is not a JSON number"),
    ("completions", [{"prompt": "w1"}], None, "must be a JSON object")]


@pytest.mark.parametrize("route, body, param, words", MALFORMED,
                         ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(MALFORMED)])
def test_malformed_parts_get_400_naming_them_on_both_servers(served, agent_url, route, body,
                                                             param, words):
    """Every malformed part (a non-object tool, function or tool call, a non-string name,
    role, text part or stop, a bad prompt list item, a body nested past 64 levels, an integer
    of 5000 digits, NaN) is a 400 naming it from serve and from the agent endpoint, never a
    500 (the openai client retries 5xx)."""
    if isinstance(body, (int, list)) and route == "chat":    # tool_calls of an assistant turn
        body = {"messages": [{**m, "tool_calls": body} if m["role"] == "assistant" else m
                             for m in CALLED]}
    for base in (served[0].base_url, agent_url):
        url = f"{base}/{'chat/completions' if route == 'chat' else 'completions'}"
        r = httpx.post(url, content=body) if isinstance(body, bytes) else \
            httpx.post(url, json=body)
        assert r.status_code == 400, (base, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (base, error)
