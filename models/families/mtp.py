"""Which checkpoints carry multi-token-prediction (MTP) layers, and whether a run trains them.

A checkpoint's MTP layers pass through conversion and training unchanged
(models.hf.passthrough) unless the run trains them (key `model.mtp.enabled`,
engine.config.mtp_settings). Then the engines read a config dict marked by `with_trained_mtp`
(the number of trained MTP layers under the key `MTP_TRAINED`, never written to a config.json:
models.hf.conditional.file_config drops it): the bridge maps the MTP layer's tensors
(models.layers.mtp.mapping) instead of carrying them, and checkpoints record it in bridge.json.

Trainable here: the families that declare `trainable_mtp` (their checkpoints store the MTP
layer as decoder layer N = num_hidden_layers with DeepSeek-V3's names enorm, hnorm, eh_proj,
shared_head: the sigmoid-routed families, models.families.sigmoid_routed), one MTP layer.
"""
from __future__ import annotations

from typing import Any

from models.families.base import field
from models.families.registry import FAMILIES, family_of

MTP_TRAINED = "_mtp_trained"


def checkpoint_mtp_layers(cfg: Any) -> int:
    """MTP layers a checkpoint of config `cfg` holds (num_nextn_predict_layers, transformers'
    num_mtp_layers, Qwen3.5's mtp_num_hidden_layers; 0: none)."""
    for name in ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"):
        value = field(cfg, name)
        if value is not None:
            return int(value)
    text = field(cfg, "text_config")
    return checkpoint_mtp_layers(text) if isinstance(text, dict) else 0


def trained_mtp_layers(cfg: Any) -> int:
    """MTP layers the run trains (0: none; the layers, if any, pass through)."""
    return int(field(cfg, MTP_TRAINED, 0))


def with_trained_mtp(hf_config: dict) -> dict:
    """A copy of the engines' config dict marked as training its MTP layers."""
    return {**hf_config, MTP_TRAINED: checkpoint_mtp_layers(hf_config)}


def mtp_training_problems(hf_config: dict) -> list[str]:
    """Why `model.mtp.enabled=true` cannot train this checkpoint's MTP layers (empty: it can)."""
    fam = family_of(hf_config)
    model_type = fam.model_type
    layers = checkpoint_mtp_layers(hf_config)
    if layers == 0:
        return [f"model.mtp.enabled=true: the checkpoint (model_type {model_type!r}) has no MTP "
                "layers (num_nextn_predict_layers / num_mtp_layers / mtp_num_hidden_layers is 0 "
                "or absent); set model.mtp.enabled=false"]
    if not getattr(fam, "trainable_mtp", False):
        trainable = sorted(t for t, f in FAMILIES.items() if getattr(f, "trainable_mtp", False))
        return [f"model.mtp.enabled=true is not supported for model_type {model_type!r}: MTP "
                f"training is built for {', '.join(trainable)} (the DeepSeek-V3 layout "
                "model.layers.{N}.enorm/hnorm/eh_proj/shared_head); its MTP layers pass "
                "through unchanged with model.mtp.enabled=false"]
    if layers != 1:
        return [f"model.mtp.enabled=true with {layers} MTP layers is not supported: one MTP "
                "layer (every published checkpoint of these families has one)"]
    return []
