"""Multi-latent attention (DeepSeek-V3 MLA) on megatron-core's MLASelfAttention, made to
compute exactly what transformers' DeepseekV3Attention computes.

Megatron's local MLA spec already matches HF's dataflow: q_a_proj -> q_a_layernorm -> q_b_proj
(or one q_proj when q_lora_rank is null), kv_a_proj_with_mqa -> [latent | shared rope key],
kv_a_layernorm, kv_b_proj -> per head [k_nope | v], RoPE on the last qk_rope_head_dim dims of
each query head and on the shared key, key = [k_nope | k_rope]. Megatron's MLA RoPE takes the
rope dims as interleaved pairs (x0, x1), (x2, x3), ... and writes them de-interleaved, as HF's
`apply_rotary_pos_emb_interleave` does (rope_interleave true): the same numbers, bitwise.
Three things differ and are replaced here:

- RoPE frequencies and YaRN's cos/sin factor: megatron computes its own YaRN; `HFRotary` holds
  transformers' inverse frequencies and `attention_factor` (ROPE_INIT_FUNCTIONS, any static
  rope type) and hands them to MLA the way megatron's YarnRotaryEmbedding does ((emb, mscale):
  cos and sin times the factor, on the rope dims only, as HF);
- the softmax scale: HF's `qk_head_dim ** -0.5` times mscale(factor, mscale_all_dim)^2
  (`yarn_apply_mscale`), computed by `hf_softmax_scale` and set on the core attention;
- the latent norms: HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever
  rms_norm_eps is (`LatentRMSNorm`); megatron would use layernorm_epsilon.

TP: the q/kv down projections are replicated linears (megatron's "duplicated" Linear, as in
its Transformer Engine spec), the up projections column-parallel by heads, linear_proj
row-parallel. (Megatron's local spec makes the down projections ColumnParallelLinear, whose
output all-gather drops, in backward, the other TP ranks' heads' share of the shared rope key's
gradient: the grad norm at TP2 + SP came out 7 % off. On the duplicated path MLA gathers the rope
key from the sequence shards instead, whose backward reduce-scatters over all heads.) Megatron
sequence parallelism (required with TP in training: every model of this family has experts):
the down projections and latent norms run on sequence shards; their weights are tagged
`sequence_parallel`, so their gradients are summed over TP. CP: Ulysses in
models.layers.attention.core (megatron's rotary slices the zigzag positions, as for GQA).
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer import multi_latent_attention as megatron_mla
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from models.families.registry import family_of
from models.families.base import field
from models.families.fields import rope_parameters
from models.hf.config import hf_config_object
from models.layers.norms.local import LocalNorm
from models.layers.attention.rope import RopeFrequencies

HF_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): default eps


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """HF deepseek_v3 `yarn_get_mscale`."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def hf_softmax_scale(cfg: Any) -> float:
    """DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale(factor,
    mscale_all_dim)^2 when rope_type is not default and mscale_all_dim is set (same order of
    operations as HF)."""
    qk_head_dim = int(field(cfg, "qk_nope_head_dim")) + int(field(cfg, "qk_rope_head_dim"))
    scaling = qk_head_dim ** (-0.5)
    params = rope_parameters(cfg)
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_mscale(params["factor"], mscale_all_dim)
            scaling = scaling * mscale * mscale
    return scaling


class HFRotary(RotaryEmbedding):
    """Megatron's RotaryEmbedding over the rope dims with transformers' inverse frequencies;
    `forward` returns (emb, attention_factor) like YarnRotaryEmbedding, so MLA multiplies cos
    and sin by HF's factor. Positions, packing (thd) and the CP zigzag slice are megatron's."""

    def __init__(self, dim: int, inv_freq: torch.Tensor, attention_factor: float, cp_group):
        super().__init__(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True,
                         cp_group=cp_group)
        if tuple(inv_freq.shape) != (dim // 2,):
            raise ValueError(f"RoPE frequencies: transformers gives {tuple(inv_freq.shape)}, "
                             f"the rope head dim {dim} needs ({dim // 2},)")
        self.inv_freq = inv_freq.float().clone()
        self.attention_factor = float(attention_factor)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None):
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.attention_factor


class HFMultiLatentAttention(MLASelfAttention):
    """MLASelfAttention with HF's RoPE frequencies / factor and softmax scale (spec params
    `inv_freq`, `attention_factor`, `softmax_scale`). config.rope_type must be "yarn": MLA's
    forward then multiplies cos/sin by the factor `HFRotary` returns. While the base class
    builds, rope_type reads "rope" (megatron's YarnRotaryEmbedding, replaced right after,
    cannot even be built without a GPU: it enters `torch.device(cuda index)`)."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=None,
                 cp_comm_type=None, pg_collection=None, *, inv_freq, attention_factor,
                 softmax_scale, **extra):
        # extra: what a newer megatron-core passes on (0.19: name), handed to the base class
        if config.rope_type != "yarn":
            raise ValueError("HFMultiLatentAttention needs MLATransformerConfig.rope_type "
                             f"'yarn' (got {config.rope_type!r})")
        kwargs = {} if attn_mask_type is None else {"attn_mask_type": attn_mask_type}
        # megatron 0.16 sets HAVE_TE when its TE extension module imports, even with TELinear
        # a stand-in (no TE): `isinstance(linear_proj, TELinear)` then raises. The local spec
        # built here has no TE linears, so the TE-only branch is off.
        megatron_mla.HAVE_TE = False
        megatron_mla.Linear = ReplicatedLinear  # None there when its TE import fails
        config.rope_type = "rope"
        try:
            super().__init__(config, submodules, layer_number, cp_comm_type=cp_comm_type,
                             pg_collection=pg_collection, **kwargs, **extra)
        finally:
            config.rope_type = "yarn"
        self.rotary_pos_emb = HFRotary(config.qk_pos_emb_head_dim, inv_freq, attention_factor,
                                       self.pg_collection.cp)
        self.softmax_scale = softmax_scale
        self.core_attention.scale = softmax_scale

    def _resolve_qk_norm_config(self, submodules):
        """megatron-core >= 0.19 (0.16 has no such step: it builds the spec's modules as they
        are): with q_lora_rank null (Moonlight), the spec's own modules. 0.19's resolver
        refuses the spec's Q norm as unused there, and with qk_layernorm it wants a Q norm
        fused into linear_q_proj (a norm+linear module: none on the local backend, so it
        raises; Transformer Engine's would norm q_proj's input a second time). HF's q_proj has
        no norm of its own; the latent KV norm stays, as with q_lora_rank (resolved by
        megatron, which keeps the spec's explicit norms and plain linears)."""
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                    kv_layernorm=submodules.kv_layernorm)


class LatentRMSNorm:
    """HF's q_a_layernorm / kv_a_layernorm: models.layers.norms.local.LocalNorm with eps 1e-6 (HF's
    default for these two norms), whatever `eps` megatron passes."""

    def __new__(cls, config, hidden_size: int, eps: float = HF_LATENT_NORM_EPS, **kwargs):
        return LocalNorm(config, hidden_size, eps=HF_LATENT_NORM_EPS)


def mla_layer_spec(layer_spec: ModuleSpec, rope: RopeFrequencies,
                   softmax_scale: float) -> ModuleSpec:
    """A deep copy of a local MLA layer spec (megatron's get_gpt_layer_local_spec with
    multi_latent_attention, core attention already swapped) with HFMultiLatentAttention and
    the latent norms. `rope`: the frequencies over the rope head dim and HF's cos/sin factor."""
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention
    if attention.module is not MLASelfAttention:
        raise TypeError(f"mla_layer_spec expects megatron's MLASelfAttention, got "
                        f"{attention.module.__name__}")
    attention.module = HFMultiLatentAttention
    attention.params = dict(attention.params or {}, inv_freq=rope.inv_freq,
                            attention_factor=rope.attention_factor,
                            softmax_scale=softmax_scale)
    attention.submodules.linear_q_down_proj = ReplicatedLinear
    attention.submodules.linear_kv_down_proj = ReplicatedLinear
    attention.submodules.q_layernorm = LatentRMSNorm
    attention.submodules.kv_layernorm = LatentRMSNorm
    return spec


def hf_rope(hf_config: Any) -> RopeFrequencies:
    """transformers' inverse frequencies (over qk_rope_head_dim) and attention factor of a
    DeepSeek-V3 config: DeepseekV3RotaryEmbedding's default, or ROPE_INIT_FUNCTIONS."""
    cfg = hf_config_object(hf_config)
    kind = rope_parameters(cfg).get("rope_type", "default")
    if kind == "default":
        inv_freq, factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return RopeFrequencies(inv_freq.float(), float(factor))


def is_mla(hf_config: Any) -> bool:
    """True for families with multi-latent attention (DeepSeek-V3)."""
    return family_of(hf_config).multi_latent_attention


def hf_mla_layer_spec(layer_spec: ModuleSpec, hf_config: Any) -> ModuleSpec:
    """`mla_layer_spec` with the RoPE and softmax scale of an HF config."""
    return mla_layer_spec(layer_spec, hf_rope(hf_config),
                          hf_softmax_scale(hf_config_object(hf_config)))
