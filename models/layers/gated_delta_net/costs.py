"""What the layers of the Qwen3.5 hybrids (models.families.qwen3_5.family) hold and cost, for parameter
counts (models.estimate.counting), the memory estimate (engine.config.recipe_validation) and the
communication plan (models.estimate.comm), where GQA's formulas would be wrong. Plain
arithmetic on an HF config (dict or transformers object); no torch, megatron or transformers.

Notation: h hidden size; a Gated DeltaNet (GDN) layer has nk key heads of width dk, nv value
heads of width dv, Kd = nk dk, Vd = nv dv, a causal conv of K taps over the 2 Kd + Vd q/k/v
channels; a full-attention layer has n query heads and g KV heads of width d (q = n d,
kv = g d); tp the tensor-parallel size, s = tp with sequence parallelism else 1; a the bytes
of an activation element (2 bf16, 4 fp32).

Parameters of one layer, (TP-sharded, replicated), the two decoder RMSNorms (2 h) included;
zero-centred norms have one weight per element, as plain ones:

- GDN: in_proj_qkv h (2 Kd + Vd), in_proj_z h Vd, in_proj_b and in_proj_a h nv each, conv1d
  (2 Kd + Vd) K, A_log and dt_bias nv each, out_proj Vd h: all split over TP by head
  (models.layers.gated_delta_net.module); the gated output norm (dv) is replicated;
- gated full attention: q_proj h 2q (each head's query and its output gate), k_proj and v_proj
  h kv, o_proj q h; q_norm and k_norm d each (replicated).

Kept activations per token of one layer, bytes on one GPU (beyond the 4 h / s of the two norm
inputs and residuals and the MLP that engine.config.recipe_validation counts for every layer):

- GDN: the projections' output a (2 Kd + 2 Vd + 2 nv) / tp; the conv's padded input and its
  output (the silu input) a 2 (2 Kd + Vd) / tp; the rule's fp32 inputs, q and k l2-normalised
  and repeated to the value heads, v, the decay and beta, 4 nv (2 dk + dv + 2) / tp; the
  recurrent state of every head at every chunk boundary, fp32 dk x dv per head per C = 64
  tokens (models.layers.gated_delta_net.rule.CHUNK; flash-linear-attention's chunk too),
  4 nv dk dv / (C tp); the chunk's fp32 intra-chunk matrix, 4 nv C / tp; the rule's output and
  the gated norm's output a 2 Vd / tp;
- gated full attention: GQA's a (q + kv_rep + q + 2 kv) / tp plus the output gate and the
  ungated attention output, a 2 q / tp.

The Ulysses CP exchange of a GDN layer (elements per token one CP rank hands in, forward): the
pre-conv q, k, v and the beta and decay inputs, then the rule's output back:
(2 Kd + 2 Vd + 2 nv) / tp (models.layers.gated_delta_net.module), again backward. A gated attention layer
exchanges q, k, v and the output as any attention (the gate stays on the sequence shard).
TP: a GDN layer is one linear block (column-parallel in_proj, row-parallel out_proj), as an
attention layer; its replicated output norm has its gradient all-reduced over TP in every
backward pass (dv elements per layer and micro-batch).
"""
from __future__ import annotations

from typing import Any

from models.families.base import field, head_dim
from models.families.registry import family_of

CHUNK = 64  # tokens per chunk of the gated delta rule (models.layers.gated_delta_net.rule.CHUNK)


def _gdn_dims(cfg: Any) -> tuple[int, int, int, int, int]:
    """(nk, dk, nv, dv, K)."""
    return (int(field(cfg, "linear_num_key_heads")), int(field(cfg, "linear_key_head_dim")),
            int(field(cfg, "linear_num_value_heads")), int(field(cfg, "linear_value_head_dim")),
            int(field(cfg, "linear_conv_kernel_dim", 4)))


def linear_layers(cfg: Any) -> set[int]:
    """0-based indices of the Gated DeltaNet layers, as the family declares them (`mixer_of`)."""
    fam = family_of(cfg)
    return {i for i in range(int(field(cfg, "num_hidden_layers")))
            if fam.mixer_of(cfg, i) == "gated_delta_net"}


def is_gdn_layer(cfg: Any, layer: int) -> bool:
    return family_of(cfg).mixer_of(cfg, layer) == "gated_delta_net"


def gdn_parameters(cfg: Any) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one GDN layer and its two decoder norms."""
    h = int(field(cfg, "hidden_size"))
    nk, dk, nv, dv, kernel = _gdn_dims(cfg)
    kd, vd = nk * dk, nv * dv
    sharded = h * (2 * kd + vd) + h * vd + 2 * h * nv + (2 * kd + vd) * kernel + 2 * nv + vd * h
    return sharded, dv + 2 * h


def gated_attention_parameters(cfg: Any) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one gated full-attention layer and its norms."""
    h, d = int(field(cfg, "hidden_size")), head_dim(cfg)
    heads = int(field(cfg, "num_attention_heads"))
    q, kv = heads * d, int(field(cfg, "num_key_value_heads", heads)) * d
    return h * 2 * q + 2 * h * kv + q * h, 2 * h + 2 * d


def layer_parameters(cfg: Any, layer: int) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of layer `layer`'s mixer and decoder norms."""
    return gdn_parameters(cfg) if is_gdn_layer(cfg, layer) else gated_attention_parameters(cfg)


def gdn_activation_bytes(cfg: Any, tp: int, a: int) -> float:
    """Kept bytes per token of one GDN layer's mixer on one GPU (module docstring)."""
    nk, dk, nv, dv, _ = _gdn_dims(cfg)
    kd, vd = nk * dk, nv * dv
    act = a * ((2 * kd + 2 * vd + 2 * nv) + 2 * (2 * kd + vd) + 2 * vd)
    fp32 = 4 * (nv * (2 * dk + dv + 2) + nv * dk * dv / CHUNK + nv * CHUNK)
    return (act + fp32) / tp


def gate_activation_bytes(cfg: Any, tp: int, a: int) -> float:
    """Kept bytes per token of a gated attention layer beyond GQA's: the gate, the ungated
    output."""
    return a * 2 * int(field(cfg, "num_attention_heads")) * head_dim(cfg) / tp


def gdn_exchange_elements(cfg: Any, tp: int) -> float:
    """Elements per token one CP rank hands to one GDN layer's Ulysses exchanges, forward."""
    nk, dk, nv, dv, _ = _gdn_dims(cfg)
    return (2 * nk * dk + 2 * nv * dv + 2 * nv) / tp


def gdn_norm_width(cfg: Any) -> int:
    """Elements of a GDN layer's replicated output norm (its gradient: all-reduced over TP)."""
    return _gdn_dims(cfg)[3]


def uses_gdn(cfg: Any) -> bool:
    """True for configs of a family that declares per-layer mixers (a Gated DeltaNet hybrid)."""
    return family_of(cfg).hybrid and bool(linear_layers(cfg))


def mean_mixer_bytes(cfg: Any, tp: int, a: int, attention_bytes: float) -> float:
    """Kept bytes per token of one layer's token mixer, averaged over the layers: the GDN
    layers' own, the attention layers' GQA bytes `attention_bytes` plus their gate."""
    layers, gdn = int(field(cfg, "num_hidden_layers")), len(linear_layers(cfg))
    gated = attention_bytes + gate_activation_bytes(cfg, tp, a)
    return (gdn * gdn_activation_bytes(cfg, tp, a) + (layers - gdn) * gated) / layers


def sp_replicated(cfg: Any, layer: int) -> int:
    """Sequence-parallel-tagged replicated weights of layer `layer` (their gradients summed
    over TP once per step): the decoder norms, an attention layer's q/k norms, and in the MoE
    variant the router and the shared expert's gate (the GDN output norm is summed per
    micro-batch instead: gdn_norm_width)."""
    h = int(field(cfg, "hidden_size"))
    experts = int(field(cfg, "num_experts", 0) or 0)
    own = 0 if is_gdn_layer(cfg, layer) else 2 * head_dim(cfg)
    return 2 * h + own + (experts * h + h if experts else 0)
