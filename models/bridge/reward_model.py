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

from models.bridge.head_checks import (CLASSIFIER_SUFFIX,  # noqa: F401 (re-exported)
                                       classifier_problem, is_reward_model_config, num_labels,
                                       reward_model_hf_config, reward_model_problem)
from models.bridge.critic import LM_HEAD, SCORE_BIAS, SCORE_WEIGHT, TrunkReader, full_head_row
from models.bridge.weights import export_hf_weights, load_hf_weights
from models.hf.io import SafetensorsReader
from models.layers.heads.value import attach_value_heads, seeded_row, value_head

__all__ = ["classifier_problem", "is_reward_model_config", "reward_model_hf_config", "reward_model_problem",
           "init_reward_model", "load_reward_model", "export_reward_model", "SCORE_WEIGHT"]


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
