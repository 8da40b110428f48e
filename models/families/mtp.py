"""Which checkpoints carry multi-token-prediction (MTP) layers, and whether a run trains them.

A checkpoint's MTP layers pass through conversion and training unchanged
(models.hf.passthrough) unless the run trains them (key `model.mtp.enabled`,
engine.config.mtp_settings). Then the engines read a config dict marked by `with_trained_mtp`
(the number of trained MTP layers under the key `MTP_TRAINED`, never written to a config.json:
models.hf.conditional.file_config drops it): the bridge maps the MTP layer's tensors
(models.layers.mtp.mapping) instead of carrying them, and checkpoints record it in bridge.json.

Trainable here: the families that declare `trainable_mtp`, one MTP layer, in either of two
layouts (`mtp_tensor_names`):
- DeepSeek-V3's (the sigmoid-routed families, models.families.sigmoid_routed: GLM-4.5,
  DeepSeek-V3, Kimi-K2): decoder layer N = num_hidden_layers, `model.layers.{N}.*`, with enorm,
  hnorm, eh_proj, shared_head.norm and copies of the embedding and output head;
- Qwen3.5's / Qwen3-Next's (models.families.qwen3_5, the family's `mtp_tensor_names` hook):
  `mtp.layers.0.*` with `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`,
  `mtp.norm` and no copies (vLLM's qwen3_5_mtp shares the target's embedding and head).
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
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


@dataclass(frozen=True)
class MTPTensorNames:
    """HF names of MTP layer k of a checkpoint. Megatron's MTP layer roles: `enorm` / `hnorm`
    (the RMSNorms of the next token's embedding and of the trunk's hidden state), `eh_proj`
    ([h, 2h] on [enorm(e); hnorm(h)]), `final_layernorm` (before the shared output head);
    `layer_prefix`: the prefix of its decoder layer's tensors (followed by the family's
    per-layer suffixes, as decoder layer N = num_hidden_layers + k names them); `copies`: {HF
    name of a stored copy: the main tensor it must equal} (the shared embedding / head)."""

    enorm: str
    hnorm: str
    eh_proj: str
    final_layernorm: str
    layer_prefix: str
    copies: dict = dc_field(default_factory=dict)

    def own(self) -> dict[str, str]:
        """{megatron MTP-layer suffix: HF name} of the layer's own tensors."""
        return {"enorm.weight": self.enorm, "hnorm.weight": self.hnorm,
                "eh_proj.weight": self.eh_proj, "final_layernorm.weight": self.final_layernorm}


def deepseek_mtp_names(cfg: Any, k: int) -> MTPTensorNames:
    """DeepSeek-V3's layout (GLM-4.5, Kimi-K2): decoder layer N + k under model.layers."""
    prefix = f"model.layers.{int(field(cfg, 'num_hidden_layers')) + k}."
    head = "model.embed_tokens.weight" if field(cfg, "tie_word_embeddings", False) \
        else "lm_head.weight"
    return MTPTensorNames(prefix + "enorm.weight", prefix + "hnorm.weight",
                          prefix + "eh_proj.weight", prefix + "shared_head.norm.weight", prefix,
                          {prefix + "embed_tokens.weight": "model.embed_tokens.weight",
                           prefix + "shared_head.head.weight": head})


def mtp_tensor_names(cfg: Any, k: int) -> MTPTensorNames:
    """The HF names of MTP layer k: the family's `mtp_tensor_names(cfg, k)` hook (a dict of
    MTPTensorNames' fields) where it has one, else DeepSeek-V3's layout."""
    hook = getattr(family_of(cfg), "mtp_tensor_names", None)
    return deepseek_mtp_names(cfg, k) if hook is None else MTPTensorNames(**hook(cfg, k))


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
                "model.layers.{N}.enorm/hnorm/eh_proj/shared_head, Qwen3.5's mtp.fc / "
                "mtp.layers.0); its MTP layers pass through unchanged with "
                "model.mtp.enabled=false"]
    hook = getattr(fam, "mtp_problems", None)   # the family's own refusals (Qwen3.5)
    problems = [] if hook is None else hook(hf_config)
    if problems:
        return problems
    if layers != 1:
        return [f"model.mtp.enabled=true with {layers} MTP layers is not supported: one MTP "
                "layer (every published checkpoint of these families has one)"]
    return []
