"""A reward model in HF form: transformers' <Family>ForSequenceClassification with num_labels 1,
i.e. the trunk's tensors under the causal LM's names without `lm_head.weight`, plus the score
head `score.weight` [1, h] (no bias; models.layers.heads.value.ValueHead with bias=False).

The score of a sequence is score.weight . h_last, with h_last the final-norm hidden state of its
LAST token (transformers' "last non-pad token" rule; the engine scores the last token of each
sequence it is given, engine.rm). On Megatron the model is the causal LM's GPTModel with the
score head on the last pipeline stage; its output layer is never used (frozen, filled with the
input embedding when the folder has no `lm_head.weight`, as models.bridge.critic does).

- `reward_model_hf_config(hf_config)`: the config.json of that form (also the config.json in
  a reward model's training checkpoint's hf_source/, so tools/convert.py recognises it:
  `is_reward_model_config`);
- `reward_model_problem(hf_dir)`: why a folder is not such a checkpoint (None: it is one);
- `init_reward_model(raw_chunks, std, seed)`: a new score head, N(0, std^2) from a seeded
  generator (layout-independent), on chunks that hold a causal LM's weights;
- `load_reward_model(raw_chunks, hf_dir, hf_config)`: fill raw (pre-DDP) chunks from a
  sequence-classification folder;
- `export_reward_model(chunks, hf_config)`: (name, full tensor) of the HF form (collective over
  each stage's TP group, like export_hf_weights).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from models.bridge.critic import LM_HEAD, SCORE_BIAS, SCORE_WEIGHT, TrunkReader, full_head_row
from models.bridge.weights import export_hf_weights, load_hf_weights
from models.families.base import UnsupportedModelError
from models.hf.config import check_config
from models.hf.io import HFCheckpointError, SafetensorsReader, read_config
from models.layers.heads.value import attach_value_heads, seeded_row, value_head

CLASSIFIER_SUFFIX = "ForSequenceClassification"

__all__ = ["classifier_problem", "is_reward_model_config", "reward_model_hf_config", "reward_model_problem",
           "init_reward_model", "load_reward_model", "export_reward_model", "SCORE_WEIGHT"]


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


def reward_model_problem(hf_dir: str) -> str | None:
    """Why `hf_dir` is not a reward model this engine loads (None: it is one): an HF folder of a
    supported family with `score.weight` [1, hidden] and no `score.bias`."""
    try:
        config = read_config(hf_dir)
        check_config(config)
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


def init_reward_model(raw_chunks: list, std: float, seed: int) -> None:
    """Attach a new score head (no bias) drawn from seeded_row(hidden, std, seed) to chunks that
    already hold a causal LM's weights."""
    hidden = raw_chunks[0].config.hidden_size
    attach_value_heads(raw_chunks, bias=False, row=seeded_row(hidden, std, seed))


def load_reward_model(raw_chunks: list, hf_dir: str, hf_config: dict) -> None:
    """Fill raw chunks from the sequence-classification folder `hf_dir` (its trunk through
    models.bridge.weights.load_hf_weights, then the score head's row). Raises ValueError when
    reward_model_problem finds one."""
    problem = reward_model_problem(hf_dir)
    if problem:
        raise ValueError(f"{hf_dir} is not a reward model: {problem}")
    reader = SafetensorsReader(hf_dir)
    load_hf_weights(raw_chunks, TrunkReader(reader, bool(hf_config.get("tie_word_embeddings"))),
                    hf_config)
    attach_value_heads(raw_chunks, bias=False, row=reader.get(SCORE_WEIGHT).float())


def export_reward_model(chunks: list, hf_config: dict, transform: Callable | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF form's tensors: the trunk (no lm_head.weight) and the whole score row.
    `transform`: as export_hf_weights' (models.lora.sites.merged_weight: LoRA merged)."""
    for name, tensor in export_hf_weights(chunks, hf_config, transform=transform):
        if name != LM_HEAD:
            yield name, tensor
    head = value_head(chunks)
    if head is not None:
        yield SCORE_WEIGHT, full_head_row(head)
