"""Example agents for env.agent (docs/agents.md): scaffolds of their own, written against the
real `openai` client, that know nothing of the engine: each gets a base_url and a dataset row
and returns its reward.

    retry        recipes/agent_cpu_demo.sh (the tiny word-level model of the CPU demos)
    math_retry   recipes/rl/qwen3_8b_agent_grpo_h100.yaml (a chat model on math prompts)

Both run the same episode: the scaffold asks the row's prompt, checks the reply itself, and
after a wrong reply sends its feedback and asks again, at most ATTEMPTS (2) calls in all:

    reward 1.0   the first reply is right (one call)
    reward 0.5   the first is wrong, the second right (two calls)
    reward 0.0   both wrong

with the metrics first_try and second_try (logged as env/first_try, env/second_try; the
calls per episode are env/turns_mean). A deliberately wrong first reply can only lose
(0.5 < 1.0). Every call of an episode trains with the episode's advantage, the wrong first
reply of a 0.5 episode included (what that does: docs/agents.md "CPU demo and the H100
recipe"). The checks leave nothing to game by format or length:

- retry: the reply, stripped of surrounding spaces, must be exactly the answer's digits ("7";
  not "7 7", "the answer is 7", "7 ?" or an empty reply). Its feedback asks again in the demo
  tokenizer's words (tools/tiny_models.py; a word outside them, "wrong" say, reads as <unk>):
  "what is the answer ?".
- math_retry: the built-in math reward (engine.rl.rewards.math_reward: the last \\boxed{}
  answer, else the last number, equal to the row's "answer" after normalisation); its
  feedback says the final answer is wrong and asks for a corrected one in \\boxed{}.

The `openai` package is in the test extra (setup.py); vLLM and SGLang depend on it too. One
OpenAI client (one HTTP connection pool) serves every episode of the process:
`with_options(base_url=...)` costs microseconds, where building a client costs about 30 ms of
CPU (measured on the 2-core host), 4 s of a 128-episode step.
"""
from __future__ import annotations

import threading

from engine.rl.rewards import math_reward

ATTEMPTS = 2
DEMO_FEEDBACK = "what is the answer ?"
MATH_FEEDBACK = ("That final answer is wrong. Find the mistake and give the corrected final "
                 "answer in \\boxed{}.")

_CLIENT = None
_LOCK = threading.Lock()


def client_for(base_url: str):
    """An OpenAI client for `base_url` sharing one connection pool with every other episode
    (no retries: a retried call would be a new branch of the episode, docs/agents.md)."""
    global _CLIENT
    with _LOCK:
        if _CLIENT is None:
            from openai import OpenAI   # the test extra's client (module docstring)

            _CLIENT = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return _CLIENT.with_options(base_url=base_url)


def is_exact(reply: str, answer) -> bool:
    """retry's check: the reply is exactly the answer's digits."""
    return reply.strip() == str(answer).strip()


def episode(base_url: str, row: dict, check, feedback: str) -> dict:
    """Ask, check the reply with check(reply, row["answer"]), after a wrong one append it and
    `feedback` and ask again; reward 1.0 / 0.5 / 0.0 (module docstring)."""
    client = client_for(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    for attempt in range(ATTEMPTS):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        if check(text, row["answer"]):
            return {"reward": 1.0 / (attempt + 1),
                    "metrics": {"first_try": float(attempt == 0),
                                "second_try": float(attempt == 1)}}
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": feedback}]
    return {"reward": 0.0, "metrics": {"first_try": 0.0, "second_try": 0.0}}


def retry(base_url: str, row: dict) -> dict:
    """The CPU demo's scaffold: exact digits, "what is the answer ?" after a wrong reply."""
    return episode(base_url, row, is_exact, DEMO_FEEDBACK)


def _math_check(reply: str, answer) -> bool:
    return math_reward("", reply, str(answer)) == 1.0


def math_retry(base_url: str, row: dict) -> dict:
    """The H100 recipe's scaffold: the math reward's check, feedback in plain English."""
    return episode(base_url, row, _math_check, MATH_FEEDBACK)
