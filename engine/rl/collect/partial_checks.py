"""The checks of rollout.partial* (partial rollouts, engine.rl.collect.partial), run by
engine.rl.checks before any process group exists: one sentence per problem naming its key."""
from __future__ import annotations

import math

from engine.generation.base import BACKENDS, custom_backend_class
from models.hf.conditional import original_config


def partial_budget(rollout) -> int:
    """Tokens a reply may decode per generation round (rollout.partial_max_new_tokens, null:
    max(1, rollout.max_new_tokens // 4))."""
    if rollout.partial_max_new_tokens is not None:
        return int(rollout.partial_max_new_tokens)
    return max(1, int(rollout.max_new_tokens) // 4)


def round_cap(cfg) -> int:
    """Rounds a step may run: ceil(rollout.max_new_tokens / partial_budget) x
    (dapo.max_gen_batches under dapo.dynamic_sampling, else 1) + 1 (a driver session's bound
    is this many rounds' tokens, engine.rl.collect.partial_session.session_steps)."""
    rollout = cfg.rollout
    return math.ceil(rollout.max_new_tokens / partial_budget(rollout)) * (
        cfg.dapo.max_gen_batches if cfg.dapo.dynamic_sampling else 1) + 1


def groups_in_flight(rollout, prompts_per_step: int) -> int:
    """ceil(rollout.partial_oversample x train.prompts_per_step): the groups a rollout batch
    keeps started (carried, waiting and new together)."""
    return math.ceil(float(rollout.partial_oversample) * prompts_per_step - 1e-9)


def applies_row_fields(backend: str) -> bool:
    """Whether rollout.backend=`backend` applies SamplingParams.first_steps and
    row_max_new_tokens: hf, vllm, or a package.module:Class subclass of their engines (which
    inherits their generate); False for sglang and any other class, or one that does not load
    (engine.rl.checks reports that)."""
    built = (BACKENDS["hf"], BACKENDS["vllm"])
    if backend in BACKENDS or ":" not in backend:
        return backend in ("hf", "vllm")
    try:
        cls = custom_backend_class(backend)
    except ValueError:
        return False
    return any(f"{c.__module__}:{c.__qualname__}" in built for c in cls.__mro__)


def partial_problems(cfg) -> list[str]:
    """The ranges of rollout.partial_* (always) and, with rollout.partial=true, what partial
    rollouts are not built for, refused by name: a backend that does not apply
    SamplingParams.first_steps / row_max_new_tokens (applies_row_fields: SGLang, a user's
    package.module:Class not derived from the hf or vllm engine), multi-turn environments
    (env.fn) and agent episodes (env.agent), an LLM judge, R3 routing replay, and
    rollout.check_behaviour_logprobs (a disaggregated run's one-version check). Both placements
    are built: colocated, and disaggregated (the collector on the rollout leader).

    Backends: on hf a continued reply draws the randomness of its own decode steps (with
    unchanged weights it is token for token the uninterrupted reply). On vllm a cut reply
    continues with a fresh seeded draw: vLLM 0.32 seeds one generator per request at its start
    and has no offset, so the continuation is seeded with engine.generation.vllm.requests
    .continuation_seed(row seed, tokens so far): deterministic (a run repeats), a valid sample
    of the policy at the new weights continuing the prefix, not the uninterrupted sample."""
    r = cfg.rollout
    p: list[str] = []
    if not isinstance(r.partial, bool):
        p.append(f"rollout.partial={r.partial!r} must be true or false")
    if not r.partial_oversample >= 1:
        p.append(f"rollout.partial_oversample={r.partial_oversample} must be >= 1 (groups in "
                 "flight per train.prompts_per_step)")
    budget = r.partial_max_new_tokens
    if budget is not None and not (isinstance(budget, int) and 1 <= budget <= r.max_new_tokens):
        p.append(f"rollout.partial_max_new_tokens={budget!r} must be an integer in [1, "
                 f"rollout.max_new_tokens={r.max_new_tokens}] or null (max_new_tokens // 4)")
    if not (isinstance(r.partial_max_staleness, int) and r.partial_max_staleness >= 0):
        p.append(f"rollout.partial_max_staleness={r.partial_max_staleness!r} must be an "
                 "integer >= 0")
    if not isinstance(r.partial_driver, bool):
        p.append(f"rollout.partial_driver={r.partial_driver!r} must be true or false")
    if r.partial is not True:
        if r.partial_driver is True:
            p.append("rollout.partial_driver=true needs rollout.partial=true")
        return p
    if not applies_row_fields(r.backend):
        p.append(f"rollout.partial=true with rollout.backend={r.backend!r} is not built: a "
                 "continued reply needs the per-row step offset and bound "
                 "(SamplingParams.first_steps / row_max_new_tokens), which rollout.backend=hf "
                 "and vllm (and subclasses of their engines) apply; use hf, vllm or "
                 "rollout.partial=false")
    if r.check_behaviour_logprobs:
        p.append("rollout.partial=true with rollout.check_behaviour_logprobs=true is not built: "
                 "the check recomputes a batch under the one version that sampled it, and a "
                 "partial batch's replies span versions (the dumps' token_versions); use "
                 "rollout.check_behaviour_logprobs=false")
    env = cfg.env
    if env.fn:
        p.append(f"rollout.partial=true with env.fn={env.fn!r} is not built: a multi-turn "
                 "episode is not cut between steps; use rollout.partial=false")
    if env.agent:
        p.append(f"rollout.partial=true with env.agent={env.agent!r} is not built: an agent "
                 "episode runs in the agent's own function; use rollout.partial=false")
    if cfg.reward.judge.base_url:
        p.append("rollout.partial=true with reward.judge.base_url is not built (the judge "
                 "scores whole generation batches); use rollout.partial=false")
    if cfg.moe.routing_replay == "R3":
        p.append("rollout.partial=true with moe.routing_replay=R3 is not built (a continued "
                 "reply's routed experts come from several calls); use R2")
    return p


def partial_model_problems(cfg, hf_config: dict) -> list[str]:
    """rollout.partial=true with a conditional-generation checkpoint (prompts with images,
    models.hf.conditional) is not built: a carried reply's prefix is the prompt's token ids plus
    its tokens, which an image prompt is not."""
    if cfg.rollout.partial is not True or original_config(hf_config) is None:
        return []
    return ["rollout.partial=true with a conditional-generation checkpoint (model_type "
            f"{original_config(hf_config).get('model_type')!r}: prompts with images) is not "
            "built; use rollout.partial=false"]
