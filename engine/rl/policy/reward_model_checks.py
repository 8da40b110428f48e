"""The checks of the reward model's keys (reward.model.*; engine.rl.policy.reward_model), used
by engine.rl.checks before any process group exists and by `--validate`: one sentence per
problem, naming its key; and the tokenizer comparison it shares with the distillation teacher's
check."""
from __future__ import annotations

import math
import os

from engine.config.schema import layout_problems, read_hf_config
from models.bridge.head_checks import reward_model_problem
from models.hf.custom_code import load_tokenizer


def vocabulary_problem(cfg, path: str, key: str, need: str) -> str | None:
    """Why the tokenizer of `path` (config key `key`) is not model.hf_path's (None: the same
    vocabulary); model.trust_remote_code covers its tokenizer code too. OSError / ValueError
    when a tokenizer does not load."""
    trust = cfg.model.trust_remote_code
    vocab = load_tokenizer(path, trust).get_vocab()
    policy = load_tokenizer(cfg.model.hf_path, trust).get_vocab()
    if vocab == policy:
        return None
    differ = sum(policy.get(tok) != i for tok, i in vocab.items())
    return (f"{key}={path}: its tokenizer is not model.hf_path's ({len(vocab)} vs "
            f"{len(policy)} tokens, {differ} differ); {need}")


def reward_key_problems(cfg) -> list[str]:
    """reward.model.* keys alone: weight a finite number, offload a boolean (true only with a
    model); no dynamic sampling with a reward model on disaggregated placement."""
    rm, p = cfg.reward.model, []
    if not (isinstance(rm.weight, (int, float)) and math.isfinite(rm.weight)):
        p.append(f"reward.model.weight={rm.weight!r} must be a finite number")
    if not isinstance(rm.offload, bool):
        p.append(f"reward.model.offload={rm.offload!r} must be true or false")
    elif rm.offload and not rm.path:
        p.append("reward.model.offload=true needs a reward model (reward.model.path is null)")
    if rm.path and cfg.dapo.dynamic_sampling and cfg.rollout.placement == "disaggregated":
        p.append("dapo.dynamic_sampling=true with reward.model.path is colocated only: on "
                 "rollout.placement=disaggregated the rollout ranks keep or drop groups before "
                 "the training ranks score them with the reward model; set "
                 "dapo.dynamic_sampling=false")
    return p


def reward_model_problems(cfg, world_size: int, policy: dict) -> list[str]:
    """reward.model.path: a one-label *ForSequenceClassification folder of a supported family
    (models.bridge.reward_model.reward_model_problem) whose vocabulary is the policy's (`policy`:
    model.hf_path's config; vocab_size equal, and its tokenizer when it ships one: it scores the
    policy's token ids) and whose shape fits the training layout (it runs at the policy's tp /
    pp / cp / ep). Its model type, hidden size and depth may differ from the policy's."""
    path = cfg.reward.model.path
    if not path:
        return []
    problem = reward_model_problem(path)
    if problem:
        return [f"reward.model.path={path}: {problem}"]
    p = reward_model_fit(cfg, world_size, policy, read_hf_config(path, "reward.model.path"))
    if _has_tokenizer(path) and _has_tokenizer(cfg.model.hf_path):
        try:
            vocab = vocabulary_problem(cfg, path, "reward.model.path", "the reward model scores "
                                       "the policy's token ids with the policy's vocabulary")
        except (OSError, ValueError) as e:
            vocab = f"reward.model.path={path}: its tokenizer does not load: {e}"
        p += [vocab] if vocab else []
    return p


def reward_model_fit(cfg, world_size: int, policy: dict, config: dict) -> list[str]:
    """What reward_model_problems checks on reward.model.path's config.json alone (`config`;
    `--validate` without the weights): vocab_size is the policy's, the shape fits the layout."""
    path = cfg.reward.model.path
    p = [] if config["vocab_size"] == policy["vocab_size"] else [
        f"reward.model.path={path}: its vocab_size {config['vocab_size']} is not model.hf_path's "
        f"{policy['vocab_size']}; the reward model scores the policy's token ids"]
    return p + [f"reward.model.path={path}: {m}" for m in layout_problems(cfg, world_size, config)]


def _has_tokenizer(path: str | None) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, f))
                              for f in ("tokenizer.json", "tokenizer_config.json"))
