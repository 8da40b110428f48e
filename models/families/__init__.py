"""The model families the bridge converts, by HF `model_type`.

Adding a family (e.g. Qwen3-MoE): one file here with a `Family` subclass (its field table,
biases / norms, layer tensors, presets; plus a `layer_map` entry in models.bridge for any new
kind of weight) and one line in FAMILIES below.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

from models.families.base import (Biases, Family, FieldRule, UnmappedTensorsError,
                                  UnsupportedArchitectureError, UnsupportedConfigError,
                                  UnsupportedModelError, field, head_dim)
from models.families.counting import StageParams, padded_vocab_size, stage_parameters
from models.families.llama import Llama
from models.families.qwen2 import Qwen2
from models.families.qwen3 import Qwen3

__all__ = ["Biases", "Family", "FieldRule", "StageParams", "UnmappedTensorsError",
           "UnsupportedArchitectureError", "UnsupportedConfigError", "UnsupportedModelError",
           "FAMILIES", "family_of", "field", "head_dim", "model_presets", "padded_vocab_size",
           "stage_parameters", "tensor_problems"]

FAMILIES: dict[str, Family] = {f.model_type: f for f in (Llama(), Qwen2(), Qwen3())}

# Tensors transformers itself drops on load: RoPE buffers of old checkpoints (recomputed from
# the config). With tied embeddings a stored lm_head.weight is replaced by the embedding.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LISTED = 8  # tensor names quoted in a message


def family_of(hf_config: Any) -> Family:
    """The Family of an HF config (dict or transformers object), or a clear error listing the
    supported model_type values."""
    model_type = field(hf_config, "model_type")
    if model_type not in FAMILIES:
        supported = ", ".join(f.describe() for f in FAMILIES.values())
        raise UnsupportedArchitectureError(
            f"unsupported architecture model_type={model_type!r} in config.json; supported "
            f"model_type values: {supported}")
    return FAMILIES[model_type]


def model_presets() -> dict[str, dict]:
    """Every family's presets: model.shape name -> public config.json values."""
    return {name: preset for f in FAMILIES.values() for name, preset in f.presets.items()}


def expected_tensors(hf_config: Any) -> set[str]:
    """Every HF tensor name the mapping reads for this config."""
    layers = field(hf_config, "num_hidden_layers")
    per_layer = family_of(hf_config).layer_tensors(hf_config)
    names = {f"model.layers.{i}.{s}" for i in range(layers) for s in per_layer}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not field(hf_config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    return names


def _listing(names: list[str]) -> str:
    more = f" ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def tensor_problems(hf_config: Any, names: Iterable[str]) -> list[str]:
    """Tensors of a checkpoint (`names`) the mapping would not consume, and tensors it needs
    that are missing; empty when they match exactly."""
    names = set(names)
    expected = expected_tensors(hf_config)
    tied = bool(field(hf_config, "tie_word_embeddings", False))
    extra = sorted(n for n in names - expected
                   if not _IGNORED.match(n) and not (tied and n == "lm_head.weight"))
    missing = sorted(expected - names)
    fam = family_of(hf_config)
    problems = []
    if extra:
        problems.append(f"the checkpoint holds {len(extra)} tensor(s) the {fam.model_type} "
                        f"mapping would not consume (they would be dropped): {_listing(extra)}; "
                        "check that config.json matches the weights (e.g. attention_bias, "
                        "mlp_bias, num_hidden_layers)")
    if missing:
        problems.append(f"the checkpoint lacks {len(missing)} tensor(s) the {fam.model_type} "
                        f"mapping needs: {_listing(missing)}")
    return problems
