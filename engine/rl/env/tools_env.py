"""The built-in tool environment, `env.fn=tools` (a class of the env.fn contract).

Each assistant turn is parsed for tool calls in the model family's format (engine.rl.env.
tool_calls, picked from the chat template). Every call runs in a tool worker process
(engine.rl.env.tool_pool) within `tool_timeout_s`, its output capped at `max_output_chars`;
each call's output, or its error (malformed call, unknown tool, raising tool, timeout) as
"error: ...", becomes one observation `{"role": "tool", "name": ..., "content": ...}` and the
episode goes on (step reward 0). A turn without any tool call is the final answer: the episode
ends and `reward.fn(prompt=, response=<that turn>, answer=, **row fields)` is its reward.
Step metrics: tool_calls (calls, malformed ones included) and tool_errors.

That reward is scored through the collector's reward scorer when it passes one (`scorer`:
engine.rl.rewards.scorer.BatchScorer, rank 0's own pool of reward.num_workers, called from the
step's thread): the same one call of reward.fn, bounded by reward.timeout_s. A call past it,
or one that raises, crashes its worker or returns a non-finite score, fails (counted in
reward/errors, reward/timeouts and reward/failures): the env keeps its "<kind>: <detail>" in
`reward_failure`, which the episode's dump record names; with reward.failure_score null its
episode's group leaves the update (engine.rl.collect.failed_groups; the step's reward is then
0, a placeholder nothing trains on), else it scores reward.failure_score. Without a scorer
(tests, direct use) reward.fn is called here and a raising call fails the step (env/errors).

env.kwargs (all optional): tool_timeout_s (default 10 s; keep it below env.step_timeout_s),
max_output_chars (default 2000).
"""
from __future__ import annotations

import math

from engine.data.render import chat_template_text
from engine.data.tool_calls import FORMATS, detect_format, parse_tool_calls
from engine.rl.env.tool_pool import ToolPool
from engine.rl.env.tool_schema import load_tools, tool_schema

TOOL_KWARGS = {"tool_timeout_s": 10.0, "max_output_chars": 2000}


def tool_kwargs_problems(kwargs: dict) -> list[str]:
    """Problems of env.kwargs for env.fn=tools."""
    p = [f"env.kwargs.{k} is not a setting of env.fn=tools (choose from "
         f"{', '.join(TOOL_KWARGS)})" for k in kwargs if k not in TOOL_KWARGS]
    for k in TOOL_KWARGS:
        if k in kwargs and not (isinstance(kwargs[k], (int, float)) and kwargs[k] > 0):
            p.append(f"env.kwargs.{k}={kwargs[k]!r} must be a number > 0")
    return p


def tool_format(tokenizer) -> str:
    """The tool-call format of the tokenizer's chat template; ValueError if none is known."""
    fmt = detect_format(chat_template_text(tokenizer))
    if fmt is None:
        raise ValueError("env.fn=tools: the chat template of model.hf_path has no known "
                         f"tool-call format ({', '.join(FORMATS)}: Qwen2.5/Qwen3 <tool_call> "
                         "tags, Llama 3.1 JSON)")
    return fmt


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") or "" for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class ToolEnv:
    """One episode of the tool environment (module docstring)."""

    def __init__(self, row: dict, *, pool: ToolPool, fmt: str, reward_fn, scorer=None) -> None:
        self.row, self.pool, self.fmt, self.reward_fn = row, pool, fmt, reward_fn
        self.scorer = scorer
        self.reward_failure: str | None = None   # the final answer's failed reward call

    def step(self, action: str) -> dict:
        parsed = parse_tool_calls(action, self.fmt)
        if parsed.is_answer:
            extra = {k: v for k, v in self.row.items()
                     if k not in ("prompt", "answer", "response")}
            item = {**extra, "prompt": _prompt_text(self.row["prompt"]), "response": action,
                    "answer": self.row["answer"]}
            if self.scorer is None:
                reward = float(self.reward_fn(**item))
            else:
                report = self.scorer.score([item])
                reward, self.reward_failure = report.scores[0], report.per_item_failures()[0]
                if math.isnan(reward):   # no score (failure_score null): the group is dropped
                    reward = 0.0
            return {"observations": [], "reward": reward, "done": True,
                    "metrics": {"tool_calls": 0.0, "tool_errors": 0.0}}
        obs = [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
        errors = len(parsed.errors)
        for call in parsed.calls:
            ok, text = self.pool.call(call.name, call.arguments)
            errors += not ok
            obs.append({"role": "tool", "name": call.name,
                        "content": text if ok else f"error: {text}"})
        return {"observations": obs, "reward": 0.0, "done": False,
                "metrics": {"tool_calls": float(len(parsed.calls) + len(parsed.errors)),
                            "tool_errors": float(errors)}}


def tool_env_factory(cfg, tokenizer, reward_fn, scorer=None):
    """(make_env(row), tool schemas for the chat template, the ToolPool) of env.fn=tools;
    `scorer` scores the final answers (module docstring)."""
    settings = {**TOOL_KWARGS, **dict(cfg.env.kwargs)}
    tools = load_tools(list(cfg.env.tools))
    schemas = [tool_schema(fn, name) for name, fn in tools.items()]
    pool = ToolPool(list(cfg.env.tools), cfg.env.num_workers, settings["tool_timeout_s"],
                    int(settings["max_output_chars"]))
    fmt = tool_format(tokenizer)
    if scorer is not None:   # its workers start now, not within the first answer's step timeout
        scorer.pool

    def make_env(row: dict) -> ToolEnv:
        return ToolEnv(row, pool=pool, fmt=fmt, reward_fn=reward_fn, scorer=scorer)

    return make_env, schemas, pool


def tool_schemas(cfg) -> list[dict] | None:
    """The JSON schemas of env.tools when env.fn=tools, else None (prompts render with them)."""
    if cfg.env.fn != "tools":
        return None
    return [tool_schema(fn, name) for name, fn in load_tools(list(cfg.env.tools)).items()]
