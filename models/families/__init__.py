"""The model families the bridge converts, by HF `model_type`.

Adding a family (e.g. Qwen3-MoE): one file here with a `Family` subclass (its field table,
biases / norms, layer tensors, presets; plus a `_LAYER_MAP` entry in models.bridge for any new
kind of weight) and one line in models/families/registry.py.
"""
from __future__ import annotations

from models.families.base import (Biases, Family, FieldRule, UnmappedTensorsError,
                                  UnsupportedArchitectureError, UnsupportedConfigError,
                                  UnsupportedModelError, field, head_dim)
from models.families.counting import StageParams, padded_vocab_size, stage_parameters
from models.families.registry import FAMILIES, family_of, model_presets
from models.families.tensors import expected_tensors, tensor_problems

__all__ = ["Biases", "Family", "FieldRule", "StageParams", "UnmappedTensorsError",
           "UnsupportedArchitectureError", "UnsupportedConfigError", "UnsupportedModelError",
           "FAMILIES", "expected_tensors", "family_of", "field", "head_dim", "model_presets",
           "padded_vocab_size", "stage_parameters", "tensor_problems"]
