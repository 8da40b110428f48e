"""The model families the bridge converts, by HF `model_type`.

Adding a family: one file here with a `Family` subclass (its field table, biases / norms,
layer tensors, presets; plus a `_LAYER_MAP` entry in models.bridge for any new kind of
weight) and one line in models/families/registry.py. A mixture-of-experts family subclasses
`MoeFamily` (models.families.moe) and declares its router/expert names as an `ExpertNaming`;
the bridge, counting and the RL weight sync read them from there (`expert_naming`).
"""
from __future__ import annotations

from models.families.base import (Biases, Family, FieldRule, UnmappedTensorsError,
                                  UnsupportedArchitectureError, UnsupportedConfigError,
                                  UnsupportedModelError, field, head_dim)
from models.families.counting import StageParams, padded_vocab_size, stage_parameters
from models.families.moe import ExpertNaming, MoeFamily
from models.families.registry import (FAMILIES, expert_naming, experts_per_layer, family_of,
                                      is_moe, model_presets, moe_family)
from models.families.tensors import expected_tensors, tensor_problems

__all__ = ["Biases", "ExpertNaming", "Family", "FieldRule", "MoeFamily", "StageParams",
           "UnmappedTensorsError", "UnsupportedArchitectureError", "UnsupportedConfigError",
           "UnsupportedModelError", "FAMILIES", "expected_tensors", "expert_naming",
           "experts_per_layer", "family_of", "field", "head_dim", "is_moe", "model_presets",
           "moe_family", "padded_vocab_size", "stage_parameters",
           "tensor_problems"]
