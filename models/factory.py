"""Build the Megatron GPTModel chunks this rank holds for an HF config, under the current
megatron parallel_state (one chunk, or `vpp` chunks with virtual pipeline parallelism)."""
from __future__ import annotations

import torch

from models.architectures import architecture_of
from models.config_bridge import model_shape, transformer_config
from models.layer_spec import layer_spec


def _rope_kwargs(hf_config: dict) -> dict:
    scaling = hf_config.get("rope_scaling") or None
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
    raise ValueError(f"unsupported rope_scaling type {kind!r} in HF config; supported: "
                     f"default, llama3")


def build_model_chunks(hf_config: dict, params_dtype: torch.dtype = torch.float32,
                       use_te: bool | None = None, **config_overrides) -> list:
    """GPTModel chunks of this rank (length vpp, or 1), in pipeline order, on this host's
    device, uninitialised weights (load them with `models.bridge.load_hf_weights`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from parallel import cpu_runtime

    architecture_of(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    config = transformer_config(hf_config, tp=tp, pp=pp, vpp=vpp, cp=cp,
                                params_dtype=params_dtype, **config_overrides)
    shape = model_shape(hf_config, tp)
    spec = layer_spec(config, use_te)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=shape.max_sequence_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=shape.rotary_base,
            vp_stage=stage,
            **_rope_kwargs(hf_config),
        )
        chunks.append(model.to(cpu_runtime.device()))
    return chunks
