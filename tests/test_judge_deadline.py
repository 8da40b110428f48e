"""The LLM judge's batch deadline (reward.judge.deadline_s) and its default verdict parser
(reward.judge.parser=number inside reward.judge.score_range), against a local fake judge
(a threaded HTTP server on loopback whose reply is the judged response's text, or no reply
at all for a response "HANG"); nothing is downloaded, no model is built."""
from __future__ import annotations

import inspect
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from engine.config.schema import load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import JudgeConfig, RLConfig
from engine.rl.judge.checks import PROCESS_GROUP_TIMEOUT_S, judge_problems
from engine.rl.judge.collector import JudgedCollector
from engine.rl.judge.scorer import JudgeScorer, load_parser, verdict_parser

OLD_DEFAULT_PARSER = r"(-?\d+(?:\.\d+)?)"   # the last number of the reply, no range


@pytest.fixture()
def fake_judge():
    """(base_url, seen): a judge replying with the response text of its prompt ("{response}"
    template); "HANG" is never answered (until teardown); `seen` counts requests."""
    release, seen = threading.Event(), {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["requests"] += 1
            text = body["messages"][0]["content"]
            if text == "HANG":
                release.wait(30)
                return
            reply = json.dumps({"choices": [{"message": {"role": "assistant",
                                                         "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    release.set()
    server.shutdown()
    server.server_close()


def _judge(base_url: str, **keys) -> JudgeConfig:
    return JudgeConfig(base_url=base_url, prompt="{response}", **keys)


def test_deadline_scores_the_unanswered_zero_and_returns_in_time(fake_judge):
    """Deadline 1.5 s, per-request timeout 60 s, concurrency 2: the answered responses keep
    their scores (an out-of-range verdict is an error), the 4 hanging ones score 0 and are
    counted, and score() returns within the deadline + 1 s. Negative control: the old bound,
    ceil(N / concurrency) x timeout_s, is minutes here, and 32 minutes for 512 responses with
    the defaults, past the process-group timeout the default deadline stays below."""
    base_url, seen = fake_judge
    cfg = _judge(base_url, deadline_s=1.5, timeout_s=60.0, concurrency=2)
    items = [("p", "7"), ("p", "Score: 3"), ("p", "9/10"), ("p", "11")] + [("p", "HANG")] * 4
    t0 = time.monotonic()
    got = JudgeScorer(cfg).score(items)
    elapsed = time.monotonic() - t0
    assert got.scores == [7.0, 3.0, 9.0] + [0.0] * 5
    assert got.num_errors == 5 and "outside reward.judge.score_range" in got.errors[3]
    assert all("deadline_s=1.5" in e for e in got.errors[4:])
    assert 1.4 < elapsed < cfg.deadline_s + 1.0, elapsed
    old_bound = math.ceil(len(items) / cfg.concurrency) * cfg.timeout_s
    assert old_bound == 240.0 > 100 * elapsed
    default = JudgeConfig()
    assert math.ceil(512 / default.concurrency) * default.timeout_s == 1920.0
    assert 1920.0 > PROCESS_GROUP_TIMEOUT_S > default.deadline_s == 600.0
    # a batch judged after the step's budget is spent sends nothing and scores 0
    sent = seen["requests"]
    got = JudgeScorer(cfg).score(items[:2], deadline_s=0.0)
    assert got.scores == [0.0, 0.0] and got.num_errors == 2 and seen["requests"] == sent


def test_timeouts_alone_take_rounds_the_deadline_cuts(fake_judge):
    """Negative control on a real run: 3 hanging responses one at a time with a 0.4 s
    timeout take 3 x 0.4 s without a deadline (60 s); a 0.5 s deadline ends them at 0.5 s."""
    base_url, _ = fake_judge
    items = [("p", "HANG")] * 3
    for deadline, low, high in [(60.0, 1.2, 3.0), (0.5, 0.45, 1.1)]:
        t0 = time.monotonic()
        got = JudgeScorer(_judge(base_url, timeout_s=0.4, concurrency=1,
                                 deadline_s=deadline)).score(items)
        elapsed = time.monotonic() - t0
        assert got.scores == [0.0] * 3 and got.num_errors == 3
        assert low < elapsed < high, (deadline, elapsed)
        assert ("deadline_s" in got.errors[-1]) == (deadline == 0.5)


def test_collector_shares_one_deadline_across_the_steps_batches(fake_judge, monkeypatch):
    """JudgedCollector: the judge's calls of one step share reward.judge.deadline_s; a second
    generation batch after a batch that spent it scores 0 (counted), and collect() restores
    the budget."""
    base_url, seen = fake_judge
    monkeypatch.setattr(RolloutCollector, "_model_scores", lambda self, part: part)
    collector = JudgedCollector.__new__(JudgedCollector)
    collector.judge = JudgeScorer(_judge(base_url, deadline_s=0.8, timeout_s=60.0))
    collector.judged, collector.judge_left_s = [], 0.8
    collector.rows = [{"prompt": "p"}]
    texts = {1: "6", 2: "HANG"}
    collector.tokenizer = type("T", (), {"decode": lambda self, ids, **k: texts[ids[0]]})()

    def part(response_ids):
        n = len(response_ids)
        return {"row_indices": [0] * n, "errors": 0, "data": {
            "prompt_ids": [[0]] * n, "response_ids": response_ids,
            "scores": torch.zeros(n), "rewards": torch.zeros(n)}}
    first = collector._model_scores(part([[1], [2]]))
    assert first["data"]["judge_scores"].tolist() == [6.0, 0.0] and first["errors"] == 1
    assert collector.judge_left_s < 0.05
    sent = seen["requests"]
    second = collector._model_scores(part([[1]]))
    assert second["data"]["judge_scores"].tolist() == [0.0] and second["errors"] == 1
    assert seen["requests"] == sent


@pytest.mark.parametrize("text, score", [
    ("8/10", 8.0), ("Score: 7", 7.0), ("8 out of 10", 8.0), ("I weigh 3 and 4; final: 9.5", 9.5),
    ("10/10", 10.0), ("Rating: 0 (out of 10)", 0.0), ("11", None), ("-1", None),
    ("score 12/10", None), ("no verdict", None), ("/10", None)])
def test_default_parser_takes_the_verdict_inside_score_range(text, score):
    """parser=number with score_range [0, 10]: the last non-denominator number, refused
    outside the range. Negative control: the old last-number rule reads "8/10" as 10."""
    parse = load_parser(JudgeConfig().parser, JudgeConfig().score_range)
    if score is None:
        with pytest.raises(ValueError):
            parse(text)
    else:
        assert parse(text) == score
    assert load_parser(OLD_DEFAULT_PARSER)("8/10") == 10.0
    assert verdict_parser(1, 5)("Score: 4/5") == 4.0


def _problems(argv: list[str]) -> list[str]:
    cfg, _ = load_config(RLConfig, ["reward.judge.base_url=http://h/v1"] + argv)
    return judge_problems(apply_algorithm_defaults(cfg, explicit_keys(argv)))


@pytest.mark.parametrize("argv, expected", [
    ([], None),
    (["reward.judge.deadline_s=0"], "reward.judge.deadline_s=0.0 must be > 0"),
    (["reward.judge.deadline_s=1800"], "below the 1800 s process-group timeout"),
    (["reward.judge.score_range=[10,0]"], "reward.judge.score_range="),
    (["reward.judge.score_range=[1]"], "reward.judge.score_range="),
])
def test_deadline_and_score_range_are_refused_by_name(argv, expected):
    got = _problems(argv)
    assert got == [] if expected is None else any(expected in p for p in got), got


def test_refusal_names_the_process_group_timeout_in_force():
    from parallel.process_groups import init_distributed
    assert inspect.signature(init_distributed).parameters["timeout_s"].default == \
        PROCESS_GROUP_TIMEOUT_S


def test_a_refused_judge_url_is_named_without_its_credentials():
    """reward.judge.base_url that is not http(s) is refused by name, its userinfo masked
    (engine.config.redaction; issue 76 item 2). Control: the URL itself is in the message."""
    got = _problems(["reward.judge.base_url=ftp://judge-user:judge-pass-Zq9@h/v1"])
    message = next(p for p in got if p.startswith("reward.judge.base_url="))
    assert "ftp://***@h/v1" in message and "judge-pass-Zq9" not in message, message
