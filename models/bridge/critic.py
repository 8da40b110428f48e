"""A PPO critic in HF form: transformers' <Family>ForTokenClassification with num_labels 1,
i.e. the trunk's tensors under the policy's names without `lm_head.weight`, plus the value
head as `score.weight` [1, h] and `score.bias` [1] (models.layers.heads.value).

- `critic_hf_config(hf_config)`: the config.json of that form (also the config.json in a
  critic's training checkpoint's hf_source/, so tools/convert.py recognises it:
  `is_critic_config`);
- `export_critic(chunks, hf_config)`: (name, full tensor) of a critic's chunks (the value
  head gathered over TP; collective over each stage's TP group, like export_hf_weights);
- `load_critic(raw_chunks, hf_dir, hf_config)`: fill raw (pre-DDP) chunks from such a folder:
  the trunk through models.bridge.weights.load_hf_weights, then a value head with this TP rank's slice
  of score.weight. The critic never uses its output layer (it is frozen, models.layers.heads.value);
  a folder without `lm_head.weight` fills it with the input embedding so that every tensor
  the bridge expects is there.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.bridge.weights import export_hf_weights, load_hf_weights
from models.bridge.head_checks import (SCORE_BIAS, SCORE_WEIGHT,  # noqa: F401 (re-exported)
                                       critic_problem)
from models.hf.io import SafetensorsReader
from models.layers.heads.value import attach_value_heads, value_head

LM_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def is_critic_config(hf_config: dict) -> bool:
    """Whether a config (an HF folder's, or a checkpoint's own config.json) is a critic's."""
    return hf_config.get("num_labels") == 1 and any(
        a.endswith("ForTokenClassification") for a in hf_config.get("architectures") or [])


def critic_hf_config(hf_config: dict) -> dict:
    """The policy's config as a one-label token classifier (transformers' naming)."""
    out = dict(hf_config)
    out["architectures"] = [a.replace("ForCausalLM", "ForTokenClassification")
                            for a in hf_config.get("architectures") or []]
    out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


class TrunkReader:
    """A SafetensorsReader without the value head, with `lm_head.weight` standing in as the
    input embedding when the folder has none (the critic's unused output layer)."""

    def __init__(self, reader: SafetensorsReader, tied: bool) -> None:
        self.reader, self.fill = reader, not tied and LM_HEAD not in reader

    def __contains__(self, name: str) -> bool:
        return name in self.keys()

    def keys(self) -> list[str]:
        names = [n for n in self.reader.keys() if n not in (SCORE_WEIGHT, SCORE_BIAS)]
        return names + ([LM_HEAD] if self.fill else [])

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(EMBEDDING if name == LM_HEAD and self.fill else name)


def load_critic(raw_chunks: list, hf_dir: str, hf_config: dict) -> None:
    reader = SafetensorsReader(hf_dir)
    for name in (SCORE_WEIGHT, SCORE_BIAS):
        if name not in reader:
            raise KeyError(f"{hf_dir} has no {name}: not a critic (a ForTokenClassification "
                           "checkpoint with num_labels 1)")
    load_hf_weights(raw_chunks, TrunkReader(reader, bool(hf_config.get("tie_word_embeddings"))),
                    hf_config)
    attach_value_heads(raw_chunks)
    head = value_head(raw_chunks)
    if head is not None:
        weight = reader.get(SCORE_WEIGHT)
        with torch.no_grad():
            head.weight.copy_(weight[:, head.start:head.start + head.width])
            head.bias.copy_(reader.get(SCORE_BIAS).reshape(1))


def export_critic(chunks: list, hf_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in export_hf_weights(chunks, hf_config):
        if name != LM_HEAD:
            yield name, tensor
    head = value_head(chunks)
    if head is None:
        return
    yield SCORE_WEIGHT, full_head_row(head)
    yield SCORE_BIAS, head.bias.detach().cpu()


def full_head_row(head) -> torch.Tensor:
    """The head's whole [1, h] weight on CPU (collective over this stage's TP group)."""
    weight = head.weight.detach()
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(weight) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, weight.contiguous(), group=ps.get_tensor_model_parallel_group())
        weight = torch.cat(parts, dim=1)
    return weight.cpu()
