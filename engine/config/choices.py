"""The configuration keys that take one of a fixed set of values, with those values, readable
without importing torch, megatron-core or transformers.

The entry points check these keys right after the command line is composed against the
schema's source (engine.cli.entry_main): `rollout.placement=foo` is refused in the time an
unknown key is (about 1 s), not after the 20 s of heavy imports the full validation needs.
So is a NAMED key (`reward.fn`) whose value is neither a built-in name nor a
"package.module:name" spec (`reward.fn=nosuch`); a spec is imported by the full validation.
`--help` (engine.config.help) lists the same choices on each key's line.

The code that uses a value keeps its own table (a loss registry, a tuple beside its checks);
SOURCES names it for every key that has one, and tests/test_cli_help.py checks that each of
those tables still holds exactly these values. The full validation after the imports checks
these keys again (with the conditions that need the model or the layout).
"""
from __future__ import annotations

import re
from typing import Any

CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "data.truncation": ("right", "error"),
    "loss.agg_mode": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"),
    "optim.schedule": ("cosine", "constant"),
    "optim.name": ("adamw", "muon"),
    "optim.muon.tp_mode": ("duplicated", "distributed", "blockwise"),
    "optim.muon.scale_mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "optim.muon.fp32_matmul_prec": ("medium", "high", "highest"),
    "parallel.cp_comm_type": ("a2a", "p2p", "all_gather"),
    "train.recompute": ("none", "selective", "full"),
    "train.recompute_method": ("uniform", "block"),
    "checkpoint.schedule": ("same", "checkpoint", "config"),
    "moe.token_dispatcher": ("alltoall", "allgather"),
    "moe.aux_loss_type": ("aux_loss", "seq_aux_loss", "global_aux_loss"),
    "moe.token_drop_policy": ("probs", "position"),
    "moe.routing_replay": ("R2", "R3"),
    "dpo.loss_type": ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"),
    "algorithm": ("grpo", "ppo", "dapo"),
    "rollout.placement": ("colocated", "disaggregated"),
    "rollout.sync_transport": ("handle", "file"),
    "reward.code_score": ("fraction", "all"),
    "reward.code_sandbox": ("strict", "relaxed"),
    "kl.estimator": ("k1", "k2", "k3"),
    "advantage.estimator": ("grpo", "rloo", "reinforce_plus_plus",
                            "reinforce_plus_plus_baseline", "gae"),
    "policy_loss": ("ppo_clip", "gspo", "geo_mean", "cispo", "sapo"),
    "rollout_correction.rollout_is": ("token", "sequence"),
    "rollout_correction.loss_type": ("ppo_clip", "reinforce"),
    # a comma list of these (every one must pass)
    "rollout_correction.rollout_rs": ("token_k1", "token_k2", "token_k3", "seq_sum_k1",
                                      "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                                      "seq_max_k3"),
}
# keys whose null is valid (its meaning is on the key's --help line)
NULL_OK = frozenset({"train.recompute_method", "moe.routing_replay",
                     "rollout_correction.rollout_is", "rollout_correction.rollout_rs"})
COMMA_LISTS = frozenset({"rollout_correction.rollout_rs"})

# key -> "module:NAME", the code's own table of the values (tests compare)
SOURCES = {
    "loss.agg_mode": "engine.training.loss:AGG_MODES",
    "optim.name": "engine.config.optim_settings:OPTIMIZERS",
    "optim.muon.tp_mode": "engine.config.optim_settings:MUON_TP_MODES",
    "optim.muon.scale_mode": "engine.config.optim_settings:MUON_SCALE_MODES",
    "optim.muon.fp32_matmul_prec": "engine.config.optim_settings:MATMUL_PRECISIONS",
    "train.recompute": "engine.config.model_settings:RECOMPUTE_CHOICES",
    "train.recompute_method": "engine.config.model_settings:RECOMPUTE_METHODS",
    "checkpoint.schedule": "engine.checkpoint.schedule:SCHEDULE_CHOICES",
    "moe.token_dispatcher": "engine.config.moe_settings:TOKEN_DISPATCHERS",
    "moe.aux_loss_type": "engine.config.moe_settings:AUX_LOSS_TYPES",
    "moe.token_drop_policy": "engine.config.moe_settings:DROP_POLICIES",
    "moe.routing_replay": "engine.config.moe_settings:ROUTING_REPLAY",
    "dpo.loss_type": "engine.config.dpo_settings:LOSS_TYPES",
    "algorithm": "engine.rl.algo.presets:ALGORITHMS",
    "rollout.placement": "engine.rl.disaggregated.checks:PLACEMENTS",
    "rollout.sync_transport": "engine.rl.checks:TRANSPORTS",
    "reward.code_score": "engine.rl.rewards.code:SCORE_MODES",
    "reward.code_sandbox": "engine.rl.rewards.code:SANDBOX_MODES",
    "kl.estimator": "engine.rl.checks:KL_ESTIMATORS",
    "policy_loss": "engine.rl.algo.policy_loss_variants:POLICY_LOSSES",
    "rollout_correction.rollout_is": "engine.rl.checks:IS_LEVELS",
    "rollout_correction.loss_type": "engine.rl.checks:LOSS_TYPES",
    "rollout_correction.rollout_rs": "engine.rl.algo.rollout_correction:RS_OPTIONS",
}

# keys taking a built-in name or the user's own "package.module:name": the built-in names (a
# value with a colon is imported and checked by the full validation)
NAMED: dict[str, tuple[str, ...]] = {
    "reward.fn": ("code", "math", "math_verify", "none"),
}
# key -> (the code's table of the names, what a user's own spec names)
NAMED_SOURCES = {
    "reward.fn": ("engine.rl.rewards.registry:BUILTIN_REWARDS", "function"),
}

_MISSING = object()


def _value(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


def choices_text(key: str) -> str | None:
    """What --help says of a choice key's values ("one of a | b"; "null or one of a | b" when
    null is valid; "a comma list of a | b" for a list key), or None for another key."""
    if key not in CHOICES:
        return None
    return (("null or " if key in NULL_OK else "")
            + ("a comma list of " if key in COMMA_LISTS else "one of ")
            + " | ".join(CHOICES[key]))


def lists_choices(key: str, meaning: str) -> bool:
    """Whether `meaning` (a key's --help text) names every choice of `key` as a word."""
    words = set(re.findall(r"[\w.-]+", meaning))
    return all(choice in words for choice in CHOICES.get(key, ()))


def named_problems(cfg: Any) -> list[str]:
    """One sentence per NAMED key of `cfg` (keys it does not have are skipped) whose value is
    neither a built-in name nor shaped "package.module:name", naming the key, the value and
    the built-ins."""
    problems = []
    for key, names in NAMED.items():
        value = _value(cfg, key)
        if value is _MISSING or value in names:
            continue
        module, colon, attr = str(value).partition(":")
        if not (isinstance(value, str) and colon and module and attr):
            kind = NAMED_SOURCES[key][1]
            problems.append(f"{key}={value!r} is not valid; choose one of {', '.join(names)} "
                            f"or give your own as package.module:{kind}")
    return problems


def choice_problems(cfg: Any) -> list[str]:
    """One sentence per choice key of `cfg` (a composed config of any entry point; keys it
    does not have are skipped) whose value is not one of its choices, naming the key, the
    value and the choices; then named_problems."""
    problems = []
    for key, choices in CHOICES.items():
        value = _value(cfg, key)
        if value is _MISSING or (value is None and key in NULL_OK):
            continue
        given = ([v.strip() for v in value.split(",") if v.strip()] if key in COMMA_LISTS
                 and isinstance(value, str) else [value])
        if any(v not in choices for v in given):
            valid = (("null",) if key in NULL_OK else ()) + choices
            problems.append(f"{key}={value!r} is not valid; choose one of "
                            f"{', '.join(valid)}")
    return problems + named_problems(cfg)


def choice_error(cfg: Any) -> str | None:
    """The refusal of `cfg`'s invalid choices (choice_problems) as the full validation words
    it (engine.config.schema.raise_problems), or None when every choice key is valid."""
    problems = choice_problems(cfg)
    if len(problems) <= 1:
        return problems[0] if problems else None
    return "invalid configuration:\n  - " + "\n  - ".join(problems)
