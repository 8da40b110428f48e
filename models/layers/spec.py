"""Transformer layer spec choice: Transformer Engine's when it imports, else the local spec with
the project's SDPA core attention and norms that support Megatron sequence parallelism
(models.layers.norms.local.LocalNorm, also as the decoder's final norm: `block_spec`); optionally an
attention output projection whose bias differs from the MLP's (megatron's `add_bias_linear`
sets both)."""
from __future__ import annotations

import importlib.util
from functools import partial

import torch
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.moe.experts import SequentialMLP

from models.layers.attention.core import SDPACoreAttention
from models.layers.experts.grouped import GroupedExperts
from models.layers.norms.local import LocalNorm


def transformer_engine_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401  (optional: the gpu extra)
    except Exception:  # a broken TE install (e.g. no CUDA) must not break the local path
        return False
    return torch.cuda.is_available()


def _with_bias(linear_cls: type, bias: bool) -> type:
    """`linear_cls` constructed with `bias=bias` whatever its caller passes."""
    class Linear(linear_cls):
        def __init__(self, *args, **kwargs):
            kwargs["bias"] = bias
            super().__init__(*args, **kwargs)

    Linear.__name__ = f"{linear_cls.__name__}{'With' if bias else 'Without'}Bias"
    Linear.__qualname__ = Linear.__name__
    return Linear


def _set_bias(spec, name: str, bias: bool) -> None:
    """Force the bias of the attention projection `name` (linear_qkv / linear_proj)."""
    attention = spec.submodules.self_attention.submodules
    linear = getattr(attention, name)
    if isinstance(linear, ModuleSpec):
        linear.module = _with_bias(linear.module, bias)
    else:
        setattr(attention, name, _with_bias(linear, bias))


def layer_spec(config, use_te: bool | None = None, linear_proj_bias: bool | None = None,
               grouped_experts: bool = True, fused_norm: bool = False):
    """The GPT layer spec for `config`; `use_te=None` picks TE when available.
    `grouped_experts` (local spec, MoE only): megatron's SequentialMLP experts computed by
    models.layers.experts.grouped.GroupedExperts (same parameters, one grouped computation).
    `fused_norm` (local spec): RMSNorms as models.layers.norms.local.FusedRMSNorm (torch.compile).

    Megatron's `add_bias_linear` biases linear_proj, the MLP and (with `add_qkv_bias`)
    linear_qkv together. `linear_proj_bias` (the attention output projection's bias) lets
    them differ, as in HF Llama with attention_bias but not mlp_bias, or the reverse; then
    linear_qkv is biased exactly when `config.add_qkv_bias`."""
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm)
    else:  # MoE: megatron's local experts (SequentialMLP of ColumnParallel/RowParallel MLPs)
        spec = specs.get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm, normalization=config.normalization,
            multi_latent_attention=config.multi_latent_attention)  # DeepSeek-V3: models.layers.mla.module
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        _use_local_norms(spec, fused_norm)
        if grouped_experts and config.num_moe_experts:
            _use_grouped_experts(spec)
    if linear_proj_bias is not None and linear_proj_bias != config.add_bias_linear:
        _set_bias(spec, "linear_proj", linear_proj_bias)
    if config.add_bias_linear and not config.add_qkv_bias:
        _set_bias(spec, "linear_qkv", False)
    return spec


def moe_submodules(spec):
    """The MoE layer's submodules (experts, router, shared_experts) of a layer spec: its mlp
    entry is a ModuleSpec in megatron-core 0.16 and a functools.partial in 0.19."""
    mlp = spec.submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules


def replace_experts(spec, old: tuple[type, ...], new: type) -> None:
    """Make the MoE layer of `spec` build its experts as `new` where it builds one of `old`
    (a ModuleSpec's module or a partial's function, either megatron-core); refuses another."""
    submodules = moe_submodules(spec)
    experts = submodules.experts
    module = experts.func if isinstance(experts, partial) else experts.module
    if module not in old:
        raise TypeError(f"{new.__name__} replaces {', '.join(c.__name__ for c in old)}; this "
                        f"megatron's spec builds {module.__name__}")
    if isinstance(experts, partial):
        submodules.experts = partial(new, *experts.args, **experts.keywords)
    else:
        experts.module = new


def _use_grouped_experts(spec) -> None:
    """Swap the MoE layer's SequentialMLP experts for GroupedExperts (its subclass)."""
    replace_experts(spec, (SequentialMLP,), GroupedExperts)


def local_norm(fused: bool = False):
    """LocalNorm as a spec entry; `fused`: RMSNorms built as FusedRMSNorm."""
    return ModuleSpec(module=LocalNorm, params={"fused": True}) if fused else LocalNorm


def _use_local_norms(spec, fused: bool = False) -> None:
    """Swap megatron's WrappedTorchNorm (it refuses sequence parallelism) for LocalNorm in the
    layer's norms; IdentityOp / other norms stay."""
    layer = spec.submodules
    attention = layer.self_attention.submodules
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name, None) is WrappedTorchNorm:
            setattr(owner, name, local_norm(fused))


def block_spec(config, layer, use_te: bool, vp_stage: int | None = None,
               fused_norm: bool = False):
    """What GPTModel's decoder of one model chunk is built from: with TE the layer spec as is;
    on the local spec a block of that layer with a LocalNorm final norm (megatron would
    otherwise pick WrappedTorchNorm, which refuses sequence parallelism)."""
    if use_te:
        return layer
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=local_norm(fused_norm))
