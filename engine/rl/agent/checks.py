"""The env.agent* keys of an RL config, checked before any process group starts
(engine.rl.checks.env_problems calls agent_problems; docs/agents.md)."""
from __future__ import annotations

import inspect

from engine.rl.env.contract import load_object


def takes_api_key(fn) -> bool:
    """Whether fn(base_url, row, api_key=...) binds (an api_key parameter or **kwargs)."""
    try:
        inspect.signature(fn).bind("url", {}, api_key="key")
    except TypeError:
        return False
    except ValueError:   # no signature (a builtin): let the call decide
        return True
    return True


def agent_problems(cfg) -> list[str]:
    """Sentences naming each violated env.agent* key (docs/agents.md): env.agent is an
    importable callable, env.fn unset; the parts of a run the agent path does not cover
    (rollout.backend=sglang, a reward model) are refused by name,
    each with its reason. (moe.routing_replay=R3: engine.rl.checks.)"""
    env = cfg.env
    agent = getattr(env, "agent", None)
    p: list[str] = []
    key = getattr(env, "agent_api_key", None)
    if key is not None and (not isinstance(key, str) or not key or not key.isprintable()
                            or any(c.isspace() for c in key)):
        p.append("env.agent_api_key must be a non-empty string without spaces (what clients "
                 "send as 'Authorization: Bearer KEY') or null (no key)")
    if agent is None:
        if key is not None:
            p.append("env.agent_api_key is set but env.agent is not: the key guards the agent "
                     "endpoint; set env.agent or leave the key out")
        return p
    if env.fn is not None:
        p.append(f"env.agent={agent!r} and env.fn={env.fn!r} are both set: an agent function "
                 "drives the episodes itself; set one of them (env.fn=null for the agent)")
    try:
        fn = load_object(agent, "env.agent")
        if not callable(fn) or isinstance(fn, type):
            p.append(f"env.agent={agent!r} is not a function(base_url, row)")
        elif key is not None and not takes_api_key(fn):
            p.append(f"env.agent_api_key is set, so env.agent={agent!r} is called "
                     "function(base_url, row, api_key=KEY); give it an api_key parameter (its "
                     "OpenAI client sends the key: OpenAI(base_url=base_url, api_key=api_key))")
    except ValueError as err:
        p.append(f"{err} (env.agent is package.module:function)")
    conc = env.agent_concurrency
    if conc is not None and (not isinstance(conc, int) or isinstance(conc, bool) or conc < 1):
        p.append(f"env.agent_concurrency={conc!r} must be an integer >= 1 or null (every "
                 "episode of the step at once)")
    if not (isinstance(env.agent_timeout_s, (int, float)) and env.agent_timeout_s > 0):
        p.append(f"env.agent_timeout_s={env.agent_timeout_s!r} must be > 0")
    if not isinstance(env.agent_host, str) or not env.agent_host:
        p.append(f"env.agent_host={env.agent_host!r} must be a host name or address")
    port = env.agent_port
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        p.append(f"env.agent_port={port!r} must be in [0, 65535] (0: a free port)")
    if env.fn is None and (not isinstance(env.max_turns, int) or env.max_turns < 1):
        p.append(f"env.max_turns={env.max_turns!r} must be an integer >= 1")
    if cfg.rollout.backend == "sglang":
        p.append("env.agent with rollout.backend=sglang is not wired: the agent path has run "
                 "on hf and vllm only (SGLang is not in the test environment); use "
                 "rollout.backend=hf or vllm (docs/agents.md)")
    if cfg.reward.model.path:
        p.append(f"env.agent with reward.model.path={cfg.reward.model.path} is refused: an "
                 "agent episode's reward is what its function returns, and an episode may "
                 "have several trajectories, so which ids a reward model would score is not "
                 "defined; score inside the function (e.g. a judge at an OpenAI-compatible "
                 "URL) (docs/agents.md)")
    return p
