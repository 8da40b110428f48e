"""Sigmoid-routed mixture-of-experts layers as DeepSeek-V3 publishes them, shared by every family
that routes this way (GLM-4.5 `glm4_moe`; DeepSeek-V3 / Kimi-K2 / Moonlight `deepseek_v3`).

HF's router (Glm4MoeTopkRouter, DeepseekV3TopkRouter, in fp32):
  s = sigmoid(x W^T)                                  scores [tokens, E]
  c = s + e_score_correction_bias                     scores used for SELECTION only
  groups: E experts in n_group groups; group score = sum of the top-2 c of the group; the
          topk_group best groups stay, the other experts are masked out
  idx = top-k of the masked c (k = num_experts_per_tok)
  w = s[idx]                                          the weights use the UNBIASED scores
  w = w / (sum w + 1e-20) if norm_topk_prob;  w = w * routed_scaling_factor
  out = sum_k w_k expert_k(x) + shared_experts(x)     (shared: one SwiGLU of width
                                                       n_shared_experts x moe_intermediate_size)
Layers 0 .. first_k_dense_replace-1 have a dense SwiGLU MLP (intermediate_size) instead.

Megatron-core 0.16.1 (`moe_utils.topk_routing_with_score_function`, score_function "sigmoid",
read line by line) computes the same numbers with:
  moe_router_score_function="sigmoid", moe_router_dtype="fp32" (router logits in fp32 as HF);
  moe_router_enable_expert_bias=True: `expert_bias` (fp32 buffer) = e_score_correction_bias,
    added to the scores for top-k only; the weights are gathered from the unbiased scores;
  then `probs = scores / (scores.sum(-1) + 1e-20)` when k > 1 (always: megatron has no switch),
    THEN `probs * moe_router_topk_scaling_factor` (normalise before scaling, as HF);
  moe_router_num_groups / moe_router_group_topk: group score = sum of the top-(k / group_topk)
    scores of the group, so it equals HF's top-2 sum only when k / topk_group == 2; groups are
    left off when they cannot restrict anything (n_group 1 or topk_group == n_group);
  moe_shared_expert_intermediate_size = n_shared_experts x moe_intermediate_size (no gate);
  moe_layer_freq = [0] x first_k_dense_replace + [1] x (layers - first_k_dense_replace).
Refused by name where megatron would differ: norm_topk_prob false with k > 1 (megatron always
renormalises sigmoid weights), norm_topk_prob true with k == 1 (megatron does not), grouped
routing with k / topk_group != 2, scoring_func other than sigmoid, topk_method other than
noaux_tc (transformers implements only that one and ignores the field).

The aux-loss-free bias update (megatron `moe_router_bias_update_rate`) is a training choice,
not a config field: engine.config.moe_settings (`moe.bias_update_rate`, default 0: off).

Plain Python (no torch, megatron or transformers), like models.families.base.
"""
from __future__ import annotations

import re
from typing import Any

from models.families.base import FieldRule, field
from models.families.moe import PROJECTIONS, ExpertNaming, MoeFamily

ROUTED = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
SHARED_EXPERTS = "mlp.shared_experts"            # {SHARED_EXPERTS}.{gate,up,down}_proj.weight
SCORE_BIAS = "mlp.gate.e_score_correction_bias"  # [E] fp32
DENSE_MLP = tuple(f"mlp.{p}_proj.weight" for p in PROJECTIONS)


def num_routed(cfg: Any) -> int:
    """Routed experts per MoE layer (`n_routed_experts`; transformers' num_local_experts)."""
    return int(field(cfg, "n_routed_experts", field(cfg, "num_local_experts", 0)))


def first_dense(cfg: Any) -> int:
    """How many leading layers are dense (first_k_dense_replace, at most every layer)."""
    return min(int(field(cfg, "first_k_dense_replace", 0)), int(field(cfg, "num_hidden_layers")))


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) has routed experts."""
    return layer >= first_dense(cfg)


def moe_layer_pattern(cfg: Any) -> list[int]:
    """megatron's moe_layer_freq as a list: 0 for a dense layer, 1 for a MoE layer."""
    return [int(is_moe_layer(cfg, i)) for i in range(int(field(cfg, "num_hidden_layers")))]


def shared_width(cfg: Any) -> int:
    """Intermediate width of the shared experts' one SwiGLU (0: none)."""
    return int(field(cfg, "n_shared_experts", 0)) * int(field(cfg, "moe_intermediate_size"))


def group_limit(cfg: Any) -> tuple[int, int] | None:
    """(moe_router_num_groups, moe_router_group_topk), or None when the groups select every
    expert anyway (n_group 1, or topk_group >= n_group)."""
    groups, keep = int(field(cfg, "n_group", 1)), int(field(cfg, "topk_group", 1))
    if groups <= 1 or keep >= groups:
        return None
    return groups, keep


def mtp_layers(cfg: Any) -> int:
    """MTP layers the checkpoint may hold (num_nextn_predict_layers; transformers'
    num_mtp_layers)."""
    return int(field(cfg, "num_nextn_predict_layers", field(cfg, "num_mtp_layers", 0)))


MTP_LAYERS = FieldRule("num_nextn_predict_layers (num_mtp_layers)", "any: the MTP layers "
                       "model.layers.{N..N+n-1}.* pass through conversion and training "
                       "unchanged (models.hf.passthrough; transformers never runs them), or "
                       "with model.mtp.enabled=true (one layer) are trained (models.layers.mtp)")


def routing_kwargs(cfg: Any) -> dict:
    """Megatron TransformerConfig kwargs of the routing above (cfg passed the field rules)."""
    limit = group_limit(cfg)
    width = shared_width(cfg)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_dtype="fp32",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,   # engine.config.moe_settings: moe.bias_update_rate
        moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(field(cfg, "routed_scaling_factor", 1.0)),
        moe_router_num_groups=limit[0] if limit else None,
        moe_router_group_topk=limit[1] if limit else None,
        moe_shared_expert_intermediate_size=width or None,
        moe_layer_freq=moe_layer_pattern(cfg),
    )


def _experts(cfg: Any) -> str | None:
    e, k = num_routed(cfg), int(field(cfg, "num_experts_per_tok", 0))
    if e >= 1 and 1 <= k <= e:
        return None
    return (f"n_routed_experts={e} with num_experts_per_tok={k} is not supported; supported: "
            "n_routed_experts >= 1 and 1 <= num_experts_per_tok <= n_routed_experts")


def _groups(cfg: Any) -> str | None:
    groups, keep = int(field(cfg, "n_group", 1)), int(field(cfg, "topk_group", 1))
    e, k = num_routed(cfg), int(field(cfg, "num_experts_per_tok", 0))
    if groups < 1 or e % groups or not 1 <= keep <= groups:
        return (f"n_group={groups} with topk_group={keep} is not supported for "
                f"n_routed_experts={e}; supported: n_group dividing the experts, 1 <= "
                "topk_group <= n_group")
    if group_limit(cfg) is None:
        return None
    if e // groups >= 2 and k % keep == 0 and k // keep == 2:
        return None
    return (f"n_group={groups} with topk_group={keep} and num_experts_per_tok={k} is not "
            "supported: HF scores a group by its top-2 experts, megatron by its top "
            "num_experts_per_tok / topk_group; supported: num_experts_per_tok = 2 x topk_group "
            "(at least 2 experts per group), n_group 1, or topk_group = n_group")


def _norm_topk(cfg: Any) -> str | None:
    norm, k = bool(field(cfg, "norm_topk_prob", False)), int(field(cfg, "num_experts_per_tok", 0))
    if norm == (k > 1):
        return None
    if norm:
        return ("norm_topk_prob=true with num_experts_per_tok=1 is not supported: HF gives the "
                "one expert weight 1, megatron's sigmoid router keeps the score; supported: k > 1")
    return ("norm_topk_prob=false is not supported with sigmoid routing: megatron-core always "
            "renormalises the k sigmoid weights; supported: true")


def _literal(name: str, allowed: str):
    def check(cfg: Any) -> str | None:
        value = field(cfg, name, allowed)
        if value == allowed:
            return None
        return (f"{name}={value!r} is not supported (transformers implements only "
                f"{allowed!r} and would ignore it); supported: {allowed}")
    return check


def _dense_count(cfg: Any) -> str | None:
    k, layers = int(field(cfg, "first_k_dense_replace", 0)), int(field(cfg, "num_hidden_layers"))
    if 0 <= k <= layers:
        return None
    return (f"first_k_dense_replace={k} is not supported; supported: 0..num_hidden_layers="
            f"{layers}")


ROUTING_FIELDS = (
    FieldRule("n_routed_experts (num_local_experts) / num_experts_per_tok", "experts >= 1, "
              "1 <= k <= experts -> num_moe_experts / moe_router_topk", _experts),
    FieldRule("moe_intermediate_size", "any -> moe_ffn_hidden_size (each routed expert)"),
    FieldRule("n_shared_experts", "0 (none) or n -> moe_shared_expert_intermediate_size = n x "
              "moe_intermediate_size (one ungated SwiGLU added to the routed output)"),
    FieldRule("first_k_dense_replace", "0..num_hidden_layers -> moe_layer_freq [0]*k + [1]*rest "
              "(dense layers use intermediate_size -> ffn_hidden_size)", _dense_count),
    FieldRule("n_group / topk_group", "no restriction (n_group 1 or topk_group = n_group) -> "
              "no groups; else num_experts_per_tok = 2 x topk_group -> moe_router_num_groups / "
              "moe_router_group_topk; refused: other group shapes", _groups),
    FieldRule("norm_topk_prob", "true with k > 1 (megatron renormalises the k sigmoid "
              "weights, then scales); refused: false, or true with k = 1", _norm_topk),
    FieldRule("routed_scaling_factor", "any -> moe_router_topk_scaling_factor (applied after "
              "the renormalisation, as HF)"),
    FieldRule("(no field) e_score_correction_bias", "the router's [E] fp32 buffer -> megatron "
              "expert_bias (moe_router_enable_expert_bias): added for the top-k choice only"),
    FieldRule("(no field) router precision", "HF computes router logits in fp32 -> "
              "moe_router_dtype fp32"),
    FieldRule("scoring_func (original config.json)", "sigmoid; refused: others",
              _literal("scoring_func", "sigmoid")),
    FieldRule("topk_method (original config.json)", "noaux_tc; refused: others",
              _literal("topk_method", "noaux_tc")),
    FieldRule("output_router_logits / router_aux_loss_coef", "training only: the default of "
              "moe.aux_loss_coeff (engine.config.moe_settings), 0 unless set"),
)


class SigmoidRoutedMoe(MoeFamily):
    """A family routed as the module docstring says: `first_k_dense_replace` dense layers, then
    MoE layers with a sigmoid router, its score-correction bias, optional expert groups and
    shared experts. Subclasses add attention (fields, biases, tensors) and set model_type."""

    experts = ROUTED
    expert_width_field = "moe_intermediate_size"
    renormalise_field = "norm_topk_prob"
    heterogeneous = True   # per-layer dense / MoE specs (models.layers.sigmoid_routing.spec)
    expert_bias = True     # routers carry e_score_correction_bias (megatron expert_bias)
    lora_hf_paths = {"mlp.shared_expert": SHARED_EXPERTS}   # HF's mlp.shared_experts
    # the MTP layer (model.layers.{N}: enorm, hnorm, eh_proj, shared_head) can be trained
    # (models.families.mtp, models.layers.mtp)
    trainable_mtp = True

    def num_experts(self, cfg: Any) -> int:
        return num_routed(cfg)

    def is_moe_layer(self, cfg: Any, layer: int) -> bool:
        return is_moe_layer(cfg, layer)

    def shared_expert_width(self, cfg: Any) -> int:
        return shared_width(cfg)

    def passthrough(self, cfg: Any, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to an MTP layer (`model.layers.{N..}.*`,
        N = num_hidden_layers): carried unchanged (models.hf.passthrough)."""
        match = re.match(r"^model\.layers\.(\d+)\.", name)
        layers = int(field(cfg, "num_hidden_layers"))
        return bool(match) and layers <= int(match.group(1)) < layers + mtp_layers(cfg)

    def attention_tensors(self, cfg: Any) -> tuple[str, ...]:
        """HF suffixes of one layer's norms and attention (families override)."""
        return tuple(n for n in super(MoeFamily, self).layer_tensors(cfg) if n not in DENSE_MLP)

    def mlp_tensors_of(self, cfg: Any, layer: int) -> tuple[str, ...]:
        if not is_moe_layer(cfg, layer):
            return DENSE_MLP
        shared = (tuple(f"{SHARED_EXPERTS}.{p}_proj.weight" for p in PROJECTIONS)
                  if shared_width(cfg) else ())
        return self.experts.layer_tensors(self.num_experts(cfg)) + (SCORE_BIAS,) + shared

    def layer_tensors_of(self, cfg: Any, layer: int) -> tuple[str, ...]:
        return self.attention_tensors(cfg) + self.mlp_tensors_of(cfg, layer)

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        """A MoE layer's tensors (layer_tensors_of gives each layer's own)."""
        return self.layer_tensors_of(cfg, int(field(cfg, "num_hidden_layers")) - 1)

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        kwargs.update(routing_kwargs(cfg), ffn_hidden_size=int(field(cfg, "intermediate_size")))
        return kwargs
