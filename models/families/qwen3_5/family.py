"""Qwen3.5 / Qwen3.6 text models, dense (`qwen3_5_text`, Qwen3_5ForCausalLM) and MoE
(`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM): Gated DeltaNet hybrids.

`layer_types` says per layer: "linear_attention" (a Gated DeltaNet layer, HF
`model.layers.{i}.linear_attn.*`, megatron models.layers.gated_delta_net.module) or "full_attention" (q_proj
emitting each head's query and a sigmoid output gate, per-head zero-centred q/k RMSNorm, GQA,
partial RoPE; megatron `attention_output_gate`). Every RMSNorm of the decoder is zero-centred
(y = norm(x) * (1 + w); models.layers.norms.zero_centered); the GDN output norm is a plain gated RMSNorm.
The MoE variant has a sparse block in every layer (softmax, top-k, always renormalised) plus a
shared expert behind a sigmoid `shared_expert_gate` (megatron moe_shared_expert_gate).

Parameter counts, kept activations and communication of the GDN and gated attention layers:
models.layers.gated_delta_net.costs; the model.shape presets: models.families.qwen3_5.presets.

The MTP layer (`mtp_num_hidden_layers` = 1; vLLM's qwen3_5_mtp / qwen3_next_mtp layout):
`mtp.fc.weight` [h, 2h] on [pre_fc_norm_embedding(e_{t+1}); pre_fc_norm_hidden(h_t)],
`mtp.layers.0.*` (a full-attention decoder layer with the model's MLP, dense or MoE) and
`mtp.norm.weight`, every norm zero-centred, the embedding and lm_head shared. With
model.mtp.enabled it is trained (models.layers.mtp; `mtp_tensor_names` gives its names),
else it passes through (models.hf.passthrough) unchanged; the conditional-generation
wrappers train it too, next to the vision tower (models.vision.model.MTPVisionLanguageModel).
Refused by name with model.mtp.enabled (`mtp_problems`): mtp_use_dedicated_embeddings=true.

Conditional-generation checkpoints (`qwen3_5` / `qwen3_5_moe`: a `text_config`, the vision
tower `model.visual.*`, the text model under `model.language_model.*`, MTP tensors `mtp.*`) are
read as their text model (models.hf.conditional); the vision tower `model.visual.*` runs in
the trainer (models.vision: images, M-RoPE), the MTP layers are `passthrough` tensors
(models.hf.passthrough), carried unchanged unless model.mtp.enabled trains them.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Family, FieldRule, field
from models.families.fields import ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE
from models.families.moe import NUM_EXPERTS, TOP_K, AUX_LOSS, ExpertNaming, MoeFamily
from models.families.qwen3_5.presets import DENSE_PRESETS, MOE_PRESETS
from models.families.fields import MROPE, WRAPPER
from models.families.qwen3_5.fields import (ATTENTION_BIAS, GDN_FIELDS, HIDDEN_ACT_SILU,
                                            LAYER_TYPES, MTP,
                                            linear_layers)

_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
ATTENTION_TENSORS = tuple(f"self_attn.{n}.weight" for n in
                          ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))
GDN_TENSORS = tuple(f"linear_attn.{n}" for n in (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"))
DENSE_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
SHARED_EXPERT = tuple(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")) + (
    "mlp.shared_expert_gate.weight",)
_COMMON = (MROPE, HIDDEN_ACT_SILU, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE,
           ATTENTION_BIAS, LAYER_TYPES) + GDN_FIELDS + (WRAPPER, MTP)
# not mapped, carried as stored: the MTP layers (transformers drops them on load)
PASSTHROUGH_PREFIXES = ("mtp.",)


def _gdn_kwargs(cfg: Any) -> dict:
    return dict(
        attention_output_gate=True,
        linear_attention_freq=[1 if i in linear_layers(cfg) else 0
                               for i in range(int(field(cfg, "num_hidden_layers")))],
        linear_conv_kernel_dim=int(field(cfg, "linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(field(cfg, "linear_key_head_dim")),
        linear_value_head_dim=int(field(cfg, "linear_value_head_dim")),
        linear_num_key_heads=int(field(cfg, "linear_num_key_heads")),
        linear_num_value_heads=int(field(cfg, "linear_num_value_heads")),
    )


class _Hybrid:
    """What both Qwen3.5 families share: per-layer tensors by layer type, GDN kwargs."""

    qk_norm = True
    hybrid = True
    # LoRA by peft's names (models.lora.sites): the gated attention's q/k/v/o_proj (q_proj's
    # rows carry the output gate), the Gated DeltaNet's in_proj_qkv / in_proj_z / in_proj_b /
    # in_proj_a / out_proj, the dense MLP or (MoE) the shared expert's gate/up/down_proj
    lora = True
    # vLLM 0.32's qwen3_5 module imports qwen3_vl, which imports transformers' Qwen2-VL image
    # processor (torchvision)
    vllm_imports_torchvision = True
    vision_prefix = "model.visual."   # the wrappers' vision tower (models.vision)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                    "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj")

    def mlp_tensors(self, cfg: Any) -> tuple[str, ...]:
        return DENSE_MLP

    def layer_tensors_of(self, cfg: Any, layer: int) -> tuple[str, ...]:
        mixer = GDN_TENSORS if layer in linear_layers(cfg) else ATTENTION_TENSORS
        return _NORMS + mixer + self.mlp_tensors(cfg)

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        """The union over both layer kinds (counting and the RL sync use layer_tensors_of)."""
        return _NORMS + ATTENTION_TENSORS + GDN_TENSORS + self.mlp_tensors(cfg)

    def passthrough(self, cfg: Any, name: str) -> bool:
        return name.startswith(PASSTHROUGH_PREFIXES)

    # model.mtp.enabled trains the mtp.* layer (models.families.mtp, models.layers.mtp)
    trainable_mtp = True

    def mtp_tensor_names(self, cfg: Any, k: int) -> dict:
        """MTP layer k's HF names (models.families.mtp.MTPTensorNames' fields), as vLLM's
        qwen3_5_mtp loads them; no stored copies of the shared embedding / lm_head."""
        return dict(enorm="mtp.pre_fc_norm_embedding.weight",
                    hnorm="mtp.pre_fc_norm_hidden.weight", eh_proj="mtp.fc.weight",
                    final_layernorm="mtp.norm.weight", layer_prefix=f"mtp.layers.{k}.",
                    copies={})

    def mtp_problems(self, cfg: Any) -> list[str]:
        """Why model.mtp.enabled=true cannot train this config's MTP layer (empty: it can)."""
        problems = []
        if field(cfg, "mtp_use_dedicated_embeddings", False):
            problems.append("model.mtp.enabled=true with mtp_use_dedicated_embeddings=true is "
                            "not supported: the MTP layer shares the model's embedding; "
                            "set model.mtp.enabled=false to carry it unchanged")
        return problems

    def layout_problems(self, cfg: Any, tp: int, cp: int) -> list[str]:
        """GDN layers split their key and value heads over TP and, with CP, over the CP ranks
        too (models.layers.gated_delta_net.module refuses the same when it builds)."""
        return [f"{name}={field(cfg, name)} is not divisible by parallel.tp x parallel.cp = "
                f"{tp} x {cp}: Gated DeltaNet layers split their heads over both"
                for name in ("linear_num_key_heads", "linear_num_value_heads")
                if int(field(cfg, name)) % (tp * cp)]

    def mixer_of(self, cfg: Any, layer: int) -> str:
        """`layer_types`: Gated DeltaNet where it says linear_attention, else gated attention."""
        return "gated_delta_net" if layer in linear_layers(cfg) else "gated_attention"


class Qwen3_5(_Hybrid, Family):
    model_type = "qwen3_5_text"
    hf_class = "Qwen3_5ForCausalLM"
    fields = _COMMON + (FieldRule("intermediate_size", "any -> ffn_hidden_size"),)
    presets = DENSE_PRESETS

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        kwargs.update(_gdn_kwargs(cfg))
        return kwargs


class Qwen3_5Moe(_Hybrid, MoeFamily):
    model_type = "qwen3_5_moe_text"
    hf_class = "Qwen3_5MoeForCausalLM"
    experts = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
    expert_width_field = "moe_intermediate_size"
    renormalise_field = None
    # and the shared expert's sigmoid gate (an nn.Linear to one output: peft's all-linear
    # adapts it; megatron's shared expert gate_weight, models.lora.sites); peft does not
    # convert names here (no conversion pattern for qwen3_5_moe_text): gate/up/down_proj are
    # the shared expert's, the routed experts only by target_parameters (`experts`)
    lora_targets = _Hybrid.lora_targets + ("shared_expert_gate",)
    fields = _COMMON + (
        FieldRule("moe_intermediate_size", "any -> moe_ffn_hidden_size"),
        FieldRule("shared_expert_intermediate_size", "any -> "
                  "moe_shared_expert_intermediate_size, with moe_shared_expert_gate (the "
                  "sigmoid shared_expert_gate)"),
        FieldRule("(no field) routing", "softmax over all experts, top-k, always "
                  "renormalised -> moe_router_pre_softmax=false"),
        NUM_EXPERTS, TOP_K, AUX_LOSS)
    presets = MOE_PRESETS

    def shared_expert_width(self, cfg: Any) -> int:
        return int(field(cfg, "shared_expert_intermediate_size"))

    def extra_layer_parameters(self, cfg: Any) -> tuple[int, int]:
        """The shared expert's sigmoid gate [1, h], replicated over TP."""
        return 0, int(field(cfg, "hidden_size"))

    def mlp_tensors(self, cfg: Any) -> tuple[str, ...]:
        return self.experts.layer_tensors(self.num_experts(cfg)) + SHARED_EXPERT

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        kwargs.update(_gdn_kwargs(cfg))
        kwargs.update(ffn_hidden_size=self.expert_width(cfg),
                      moe_shared_expert_intermediate_size=int(
                          field(cfg, "shared_expert_intermediate_size")),
                      moe_shared_expert_gate=True)
        return kwargs
