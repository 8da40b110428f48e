"""The judge's requests: one chat completion per (prompt, response), concurrently, with a
timeout each and one deadline for the whole batch; the reply's text parsed into a score.

Request (POST {base_url}/chat/completions): {"model": reward.judge.model, "messages": [{"role":
"user", "content": the template}], "max_tokens", "temperature"}; with reward.judge.api_key_env
the header `Authorization: Bearer <that variable's value>`. The template is reward.judge.prompt
with every literal `{prompt}` and `{response}` replaced (in one pass: braces of other kinds, and
such words inside the filled texts, stay as written).

Parser (reward.judge.parser): "number" (the default) takes the verdict, the LAST number of the
reply that is not a denominator (the 10 of "8/10" or "8 out of 10"), and accepts it only inside
reward.judge.score_range [low, high]: "8/10" scores 8, "Score: 7" 7, "11" with [0, 10] is
unparsable (no fallback to an earlier number); "package.module:function" is called with the
reply's text and returns the score; anything else is a regular expression with exactly one
group, and the score is float(the group) of its LAST match (a judge that reasons first states
its verdict last).

Failures: a request that fails (connection, HTTP status other than 200, a body without a text
reply), runs past reward.judge.timeout_s (counted from when it is sent: at most
reward.judge.concurrency are in flight), is not answered when the batch's deadline passes
(JudgeScorer.score's `deadline_s`, reward.judge.deadline_s by default: queued and in-flight
requests are cancelled then), or whose reply does not parse into a finite float scores 0.0 and
is counted (the collector adds the count to reward/errors). So one score() call returns within
its deadline plus the time to cancel (milliseconds), however many requests hang.
"""
from __future__ import annotations

import asyncio
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from engine.rl.env.contract import load_object

FIELDS = re.compile(r"\{(prompt|response)\}")
FUNCTION_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
DENOMINATOR = re.compile(r"(?:/|\bout\s+of)\s*$", re.IGNORECASE)   # what precedes a denominator


def fill(template: str, prompt: str, response: str) -> str:
    """The template with {prompt} and {response} replaced (module docstring)."""
    values = {"prompt": prompt, "response": response}
    return FIELDS.sub(lambda m: values[m.group(1)], template)


def verdict_parser(low: float, high: float) -> Callable[[str], float]:
    """parser=number with score_range [low, high] (module docstring): text -> the verdict;
    ValueError when the reply has no number outside denominators or the verdict is out of range."""
    def parse(text: str) -> float:
        verdicts = [m for m in NUMBER.finditer(text) if not DENOMINATOR.search(text[:m.start()])]
        if not verdicts:
            raise ValueError("no number (other than a denominator such as the 10 of 8/10)")
        value = float(verdicts[-1].group())
        if not low <= value <= high:
            raise ValueError(f"verdict {verdicts[-1].group()} is outside "
                             f"reward.judge.score_range=[{low:g}, {high:g}]")
        return value
    return parse


def load_parser(spec: str, score_range=(0.0, 10.0)) -> Callable[[str], float]:
    """reward.judge.parser as a function text -> float (module docstring; `score_range` is
    parser=number's [low, high]); ValueError naming the key when it is neither "number", a
    loadable function nor a regex with one group."""
    if spec == "number":
        return verdict_parser(float(score_range[0]), float(score_range[1]))
    if FUNCTION_SPEC.fullmatch(spec):
        fn = load_object(spec, "reward.judge.parser")
        if not callable(fn) or isinstance(fn, type):
            raise ValueError(f"reward.judge.parser={spec!r} is not a function(text) -> float")
        return lambda text: float(fn(text))
    try:
        pattern = re.compile(spec)
    except re.error as e:
        raise ValueError(f"reward.judge.parser={spec!r} is neither package.module:function "
                         f"nor a regular expression ({e})") from None
    if pattern.groups != 1:
        raise ValueError(f"reward.judge.parser={spec!r} has {pattern.groups} groups; a regex "
                         "needs exactly one, the score (e.g. 'Score: (\\d+)')")

    def parse(text: str) -> float:
        matches = list(pattern.finditer(text))
        if not matches:
            raise ValueError(f"no match of {spec!r}")
        return float(matches[-1].group(1))
    return parse


@dataclass
class JudgeScores:
    scores: list[float]            # one per item; 0.0 where it failed
    errors: list[str | None]       # why each item failed, None where it did not

    @property
    def num_errors(self) -> int:
        return sum(e is not None for e in self.errors)


class JudgeScorer:
    """The judge of reward.judge `cfg` (a JudgeConfig; module docstring)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.parse = load_parser(cfg.parser, list(cfg.score_range))
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def body(self, prompt: str, response: str) -> dict:
        return {"model": self.cfg.model, "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature,
                "messages": [{"role": "user", "content": fill(self.cfg.prompt, prompt,
                                                              response)}]}

    def score(self, items: list[tuple[str, str]],
              deadline_s: float | None = None) -> JudgeScores:
        """The score of each (prompt text, response text), in order, all within `deadline_s`
        seconds from now (None: reward.judge.deadline_s; <= 0: none is sent, all score 0);
        module docstring."""
        if not items:
            return JudgeScores([], [])
        deadline_s = self.cfg.deadline_s if deadline_s is None else deadline_s
        if deadline_s <= 0:
            why = (f"not judged: this step's reward.judge.deadline_s={self.cfg.deadline_s} "
                   "had passed")
            return JudgeScores([0.0] * len(items), [why] * len(items))
        loop = asyncio.new_event_loop()   # closed without waiting for stuck resolver threads
        try:
            results = loop.run_until_complete(self._score_all(items, deadline_s))
        finally:
            loop.close()
        return JudgeScores([s for s, _ in results], [e for _, e in results])

    async def _score_all(self, items: list[tuple[str, str]],
                         deadline_s: float) -> list[tuple[float, str | None]]:
        gate = asyncio.Semaphore(self.cfg.concurrency)
        limits = httpx.Limits(max_connections=self.cfg.concurrency)
        late = (0.0, f"not answered within reward.judge.deadline_s={self.cfg.deadline_s} "
                     f"(this batch's {deadline_s:.3g} s)")
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s, limits=limits,
                                     headers=self.headers) as client:
            tasks = [asyncio.ensure_future(self._one(client, gate, p, r)) for p, r in items]
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return [late if task in pending else task.result() for task in tasks]

    async def _one(self, client: httpx.AsyncClient, gate: asyncio.Semaphore, prompt: str,
                   response: str) -> tuple[float, str | None]:
        async with gate:
            try:
                reply = await asyncio.wait_for(client.post(self.url, json=self.body(
                    prompt, response)), self.cfg.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                return 0.0, f"no answer within reward.judge.timeout_s={self.cfg.timeout_s}"
            except httpx.HTTPError as e:
                return 0.0, f"{type(e).__name__}: {e}"
        return self.read(reply)

    def read(self, reply: httpx.Response) -> tuple[float, str | None]:
        """(score, None) from a judge's HTTP reply, or (0.0, why it failed)."""
        if reply.status_code != 200:
            return 0.0, f"HTTP {reply.status_code}: {reply.text[:200]}"
        try:
            text = reply.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return 0.0, f"not a chat completion: {reply.text[:200]}"
        try:
            value = self.parse(text or "")
        except Exception as e:  # noqa: BLE001 - a user parser may raise anything
            return 0.0, f"unparsable reply {text!r:.120}: {e}"
        if not math.isfinite(value):
            return 0.0, f"non-finite score {value} from reply {text!r:.120}"
        return value, None
