"""The checks of a critic's and of a reward model's HF folder, before any process group exists:
`critic_problem` (critic.hf_path, RL), `reward_model_problem` (reward.model.path, RL) and the
config.json reads of a reward model (`is_reward_model_config`, `classifier_problem`: engine.rm's
checks, engine.config.rm_settings).
models.bridge.critic and models.bridge.reward_model, which load and export those models,
re-export them. No megatron-core here, so the RL config checks (`--validate`) import this
module at start-up; transformers' config classes (models.hf.config.check_config) load when a
folder is checked.
"""
from __future__ import annotations

from models.families.base import UnsupportedModelError
from models.hf.io import HFCheckpointError, SafetensorsReader, read_config

SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def check_hf_config(hf_config: dict) -> None:
    """models.hf.config.check_config, imported at the first folder checked (the config checks
    of engine.config.schema and this module's, before transformers is needed)."""
    from models.hf.config import check_config  # transformers: only a configured folder's check
    check_config(hf_config)


def critic_problem(hf_dir: str, policy_dir: str) -> str | None:
    """Why `hf_dir` is not a critic for the policy at `policy_dir` (None: it is one): it must
    be this module's HF form, with the policy's model type, hidden size, layers and vocabulary
    (tools/convert.py mcore-to-hf writes it from checkpoint.dir/critic)."""
    try:
        critic = read_config(hf_dir)
        policy = read_config(policy_dir) if policy_dir else critic
        check_hf_config(critic)
        if SCORE_WEIGHT not in SafetensorsReader(hf_dir):
            return "no score.weight (not a *ForTokenClassification critic with num_labels 1)"
    except (HFCheckpointError, UnsupportedModelError, OSError) as e:
        return str(e)
    differ = [k for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
              if critic.get(k) != policy.get(k)]
    return f"its {', '.join(differ)} differ from model.hf_path's" if differ else None


def reward_model_problem(hf_dir: str) -> str | None:
    """Why `hf_dir` is not a reward model this engine loads (None: it is one): an HF folder of a
    supported family with `score.weight` [1, hidden] and no `score.bias`."""
    try:
        config = read_config(hf_dir)
        check_hf_config(config)
        reader = SafetensorsReader(hf_dir)
        if SCORE_WEIGHT not in reader:
            return ("no score.weight: not a *ForSequenceClassification checkpoint "
                    "(num_labels 1)")
        shape = tuple(reader.get(SCORE_WEIGHT).shape)
    except (HFCheckpointError, UnsupportedModelError, OSError) as e:
        return str(e)
    if shape != (1, config["hidden_size"]):
        return (f"score.weight is {list(shape)}, not [1, {config['hidden_size']}] "
                "(a reward model has num_labels 1)")
    if SCORE_BIAS in reader:
        return ("it has score.bias: a *ForSequenceClassification score head has no bias (a "
                "*ForTokenClassification critic is read with critic.hf_path)")
    return None


def is_reward_model_config(hf_config: dict) -> bool:
    """Whether a config (an HF folder's, or a checkpoint's own config.json) is a reward model's:
    a *ForSequenceClassification architecture with num_labels 1."""
    return num_labels(hf_config) == 1 and any(
        a.endswith(CLASSIFIER_SUFFIX) for a in hf_config.get("architectures") or [])


def num_labels(hf_config: dict) -> int:
    """transformers' rule: `num_labels` if given, else the size of `id2label`, else 2."""
    if hf_config.get("num_labels") is not None:
        return int(hf_config["num_labels"])
    return len(hf_config["id2label"]) if hf_config.get("id2label") else 2


def reward_model_hf_config(hf_config: dict) -> dict:
    """The causal LM's (or a reward model's own) config as a one-label sequence classifier
    (transformers' naming)."""
    out = dict(hf_config)
    out["architectures"] = [a.replace("ForCausalLM", CLASSIFIER_SUFFIX)
                            for a in hf_config.get("architectures") or []]
    out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


def classifier_problem(hf_config: dict) -> str | None:
    """Why a model's reward-model form would not load in transformers (None: it would): the
    export is transformers' <Family>ForSequenceClassification, which must exist (it does for
    Qwen3, Qwen2, Llama, Qwen3-MoE, Mixtral, DeepSeek-V3/Kimi-K2, gpt-oss and Qwen3.5's text
    model in transformers 5.19; not for GLM-4.5 or vision-language wrappers)."""
    import transformers  # heavy; only a reward-model check needs its class list

    names = reward_model_hf_config(hf_config)["architectures"]
    known = [n for n in names if n.endswith(CLASSIFIER_SUFFIX) and hasattr(transformers, n)]
    if known:
        return None
    return (f"transformers {transformers.__version__} has no sequence-classification class for "
            f"architectures {hf_config.get('architectures')} (looked for {names}); reward "
            "models need one")
