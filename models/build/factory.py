"""Build the Megatron GPTModel chunks this rank holds for an HF config, under the current
megatron parallel_state (one chunk, or `vpp` chunks with virtual pipeline parallelism)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           VocabParallelEmbedding)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from models.build.compile_layers import compile_layers as compile_model_layers
from models.build.megatron_patches import install_all as install_megatron_patches
from models.build.transformer_config import model_shape, transformer_config
from models.families.mtp import trained_mtp_layers
from models.families.registry import family_of
from models.hf.conditional import peft_layers
from models.hf.config import check_config, hf_config_object
from models.layers.spec import block_spec, layer_spec, transformer_engine_available
from models.lora.adapters import LoraSpec
from models.lora.sites import apply_lora
from models.layers.attention.rope import install_rope
from models.layers.biased_experts.fused import lora_row_orders as expert_lora_row_orders
from models.layers.mla.mapping import lora_row_orders
from models.layers.mla.module import hf_mla_layer_spec, is_mla
from models.layers.biased_experts.spec import biased_moe_spec, has_biased_experts
from models.layers.mtp.model import MTPGPTModel
from models.layers.mtp.spec import mtp_block_spec
from models.layers.gated_delta_net.spec import gpt_model_kwargs, hybrid_block_spec, is_hybrid
from models.layers.sigmoid_routing.spec import is_heterogeneous, routed_block_spec
from models.vision.model import MTPVisionLanguageModel, VisionLanguageModel
from models.vision.spec import vision_spec
from models.vision.tower import build_tower
from parallel import cpu_runtime


def build_model_chunks(hf_config: dict, params_dtype: torch.dtype = torch.float32,
                       use_te: bool | None = None, grouped_experts: bool = True,
                       fused_norm: bool = False, lora: LoraSpec | None = None,
                       train_vision: bool = False, compile_layers: bool = False,
                       **config_overrides) -> list:
    """GPTModel chunks of this rank (length vpp, or 1), in pipeline order, on this host's
    device, uninitialised weights (load them with `models.bridge.weights.load_hf_weights`).
    Raises UnsupportedArchitectureError / UnsupportedConfigError before building anything
    when the HF config does not map exactly. `config_overrides` are TransformerConfig fields
    (e.g. sequence_parallel, recompute_granularity: engine.config.model_settings).
    On the local spec, `grouped_experts` computes MoE experts with models.layers.experts.grouped
    (key moe.grouped_experts) and `fused_norm` builds compiled RMSNorms (key
    model.fusions.rmsnorm; engine.config.fusion_settings). `lora`: freeze the base and attach
    LoRA adapters (models.lora.sites; always on the local spec, whose linears see the normed
    input). A checkpoint with a vision tower (models.vision.spec) builds VisionLanguageModel
    chunks, the tower on the first stage, trained when `train_vision` (key
    model.vision.freeze=false); with a trained MTP layer too, MTPVisionLanguageModel.
    `compile_layers` (key train.compile): every transformer layer under torch.compile
    (models.build.compile_layers; compiled lazily at its first forward, after LoRA attaches)."""
    check_config(hf_config)
    install_megatron_patches()   # every model-level change to megatron-core (one registry)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    _layout_overrides(config_overrides, cp)
    config_overrides.setdefault("mtp_num_layers", trained_mtp_layers(hf_config) or None)
    config = transformer_config(hf_config, tp=tp, pp=pp, vpp=vpp, cp=cp,
                                params_dtype=params_dtype, **config_overrides)
    shape = model_shape(hf_config, tp)
    biases = family_of(hf_config).biases(hf_config_object(hf_config))
    use_te = transformer_engine_available() if use_te is None else use_te
    # The family's declared layer kinds pick the specs (models.families.base, .moe):
    hybrid = is_hybrid(hf_config)  # per-layer mixers (Gated DeltaNet): local spec only
    heterogeneous = is_heterogeneous(hf_config)  # dense layers, then MoE: local spec only
    use_te = use_te and not hybrid and not heterogeneous
    use_te = use_te and lora is None and not has_biased_experts(hf_config)  # local spec
    mla = is_mla(hf_config)  # HF-exact MLA on the local spec (models.layers.mla.module)
    use_te = use_te and not mla

    def make_spec(cfg):
        spec = layer_spec(cfg, use_te, linear_proj_bias=biases.o_proj,
                          grouped_experts=grouped_experts, fused_norm=fused_norm)
        return hf_mla_layer_spec(spec, hf_config) if mla else spec

    spec = biased_moe_spec(make_spec(config), hf_config)  # declared router/expert biases
    vision = vision_spec(hf_config)
    mtp = trained_mtp_layers(hf_config) > 0  # on the last stage: models.layers.mtp
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        extra = {} if vision is None else dict(
            vision_spec=vision,
            tower=build_tower(hf_config, params_dtype, train_vision) if pre_process else None)
        extra.update(_mtp_kwargs(config, hf_config, make_spec, fused_norm, stage) if mtp else {})
        model = _model_class(vision is not None, mtp)(
            config=config,
            transformer_layer_spec=(
                hybrid_block_spec(config, spec, hf_config, stage) if hybrid
                else routed_block_spec(config, make_spec, stage, fused_norm) if heterogeneous
                else block_spec(config, spec, use_te, stage, fused_norm)),
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=shape.max_sequence_length,
            pre_process=pre_process,
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=shape.rotary_base,
            vp_stage=stage,
            **(gpt_model_kwargs(hf_config) or _rotary_kwargs(hf_config)),
            **extra,
        )
        if not mla:  # MLA layers hold their own RoPE (models.layers.mla.module.HFRotary)
            install_rope(model, hf_config)
        _tag_tensor_parallel_params(model)
        chunks.append(model.to(cpu_runtime.device()))
    _adapt(chunks, hf_config, lora, compile_layers)
    return chunks


def _adapt(chunks: list, hf_config: dict, lora: LoraSpec | None, compile_layers: bool) -> None:
    """LoRA adapters attached (then the layers compiled: the adapters are part of them)."""
    if lora is not None:
        apply_lora(chunks, lora, {**lora_row_orders(hf_config),
                                  **expert_lora_row_orders(hf_config)},
                   peft_layers(hf_config), family_of(hf_config).lora_hf_paths)
    if compile_layers:
        compile_model_layers(chunks)


def _model_class(vision: bool, mtp: bool) -> type:
    """The megatron model class of a chunk: with a vision tower, with a trained MTP layer."""
    if vision:
        return MTPVisionLanguageModel if mtp else VisionLanguageModel
    return MTPGPTModel if mtp else GPTModel


def _mtp_kwargs(config, hf_config: dict, make_spec, fused_norm: bool, stage) -> dict:
    """MTPGPTModel's mtp_block_spec on the chunk that holds the MTP layer: the last pipeline
    stage's last chunk (megatron's placement without a custom pipeline layout)."""
    if not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage):
        return {}
    return {"mtp_block_spec": mtp_block_spec(config, hf_config, make_spec, fused_norm)}


def _layout_overrides(config_overrides: dict, cp: int) -> None:
    """TransformerConfig fields the current parallel layout needs (set unless given)."""
    if cpu_runtime.is_cpu_host():
        # gloo matches messages between two ranks in posting order; megatron's batched p2p
        # posts send-to-prev before send-to-next, which with pp=2 (prev == next) swaps
        # activations and gradients in the interleaved schedule. Unbatched p2p orders by rank.
        config_overrides.setdefault("batch_p2p_comm", False)
    if ps.get_expert_model_parallel_world_size() > 1:  # megatron refuses it for dense models
        config_overrides.setdefault("expert_model_parallel_size",
                                    ps.get_expert_model_parallel_world_size())
        config_overrides.setdefault("expert_tensor_parallel_size",
                                    ps.get_expert_tensor_parallel_world_size())
    if cp > 1:  # read by Transformer Engine's CP attention; our Ulysses path is always a2a
        config_overrides.setdefault("cp_comm_type", "a2a")


def _rotary_kwargs(hf_config: dict) -> dict:
    """GPTModel's rotary_percent when the family rotates part of each head (GLM-4.5)."""
    fraction = family_of(hf_config).rotary_percent(hf_config_object(hf_config))
    return {} if fraction == 1.0 else {"rotary_percent": fraction}


def _tag_tensor_parallel_params(model) -> None:
    """Mark TP-sharded weights as such. Megatron sets these attributes only inside its weight
    initialisers, which we skip (`perform_initialization=False`: weights come from HF); without
    them the grad-norm and clipping code would treat shards as TP duplicates."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
