"""Whether env.fn can work with the model's chat template (it must place observations; with
env.fn=tools it must have a known tool-call format): checked in validation, before any process
group exists, and on every rank at start."""
from __future__ import annotations

from engine.rl.env.names import ENV_TOOLS
from engine.rl.env.observation import observation_text


def env_template_problem(cfg, tokenizer=None) -> str | None:
    """Why env.fn cannot work with model.hf_path's chat template (it cannot place observations,
    or with env.fn=tools has no known tool-call format), or None. `tokenizer`: loaded from
    model.hf_path when not given."""
    if getattr(cfg, "env", None) is None or cfg.env.fn is None:
        return None
    try:
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        schemas = None
        if cfg.env.fn == ENV_TOOLS:
            from engine.rl.env.tools_env import tool_format, tool_schemas
            tool_format(tokenizer)
            schemas = tool_schemas(cfg)
        observation_text(tokenizer, [{"role": "user", "content": "probe"}],
                         [{"role": "user", "content": "probe"}], schemas)
    except Exception as e:  # noqa: BLE001 - RunError / ValueError / a template error
        return str(e) if str(e).startswith("env.") else f"env.fn={cfg.env.fn!r}: {e}"
    return None


def check_env_start(cfg, tokenizer) -> None:
    """Every rank at start: ConfigError with env_template_problem's reason, if any (validation
    already refused it before the process groups started when model.hf_path has a
    tokenizer)."""
    from engine.errors import ConfigError

    problem = env_template_problem(cfg, tokenizer)
    if problem is not None:
        raise ConfigError(problem)
