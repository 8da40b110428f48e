"""Weight mapping between HF checkpoints and Megatron `GPTModel` chunks at any TP/PP/VPP.

`load_hf_weights(chunks, reader, hf_config)` fills the local shards of every chunk of this rank
from HF tensors. `export_hf_weights(chunks, hf_config)` yields `(hf_name, full_tensor)` for the
layers this pipeline stage holds, gathering TP shards over the tensor-parallel group (a
collective: every TP rank of the stage must iterate it together). Both handle the local and the
Transformer Engine layer specs, fused QKV (per query group) and gate/up (per TP rank), vocab
padding, PP/VPP layer offsets and tied embeddings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps

from models.bridge import kinds
from models.layers import transforms as wm
from models.build.transformer_config import model_shape
from models.families.moe import ExpertNaming
from models.families.base import UnmappedTensorsError
from models.families.registry import expert_naming
from models.families.tensors import tensor_problems
from models.hf.config import check_config
from models.lora.sites import is_adapter_param
from models.formats.quantized import DequantizingReader
from models.layers.biased_experts.fused import fuse_experts, fused_expert_reader
from models.layers.mtp.mapping import mtp_mapping, shared_copies
from models.layers.sigmoid_routing.mapping import mapped_buffers
from models.vision.tower import VISION_PREFIX, tower_tensor_problems
from parallel.wrappers import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> (kind, HF suffixes under model.layers.{i}.)
_LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "self_attention.linear_proj.bias": ("replicated", ("self_attn.o_proj.bias",)),
    # attention sinks (gpt-oss; models.layers.attention.sinks): one logit per head, split with them
    "self_attention.core_attention.softmax_offset": ("heads", ("self_attn.sinks",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc1.bias": ("fc1", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": ("replicated", ("mlp.down_proj.bias",)),
}  # what a layer kind maps itself (MoE experts, MLA, GDN, ...): models.bridge.kinds
_TOP_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}


@dataclass
class _Mapping:
    kind: str
    hf_names: tuple[str, ...]


def _mapping(chunk, name: str, tied: bool, naming: ExpertNaming | None, hf_config: dict
             ) -> _Mapping | None:
    """HF names for one megatron parameter of `chunk`, or None for entries with no HF twin.
    `naming`: the family's MoE router/expert names (None: dense). The vision tower's
    parameters (models.vision.tower) are replicated under their HF names."""
    vision = getattr(chunk, "vision_spec", None)
    if vision is not None and name.startswith(VISION_PREFIX):
        return _Mapping("replicated", (vision.hf_prefix + name[len(VISION_PREFIX):],))
    match = _LAYER.match(name)
    if match:
        local, suffix = int(match.group(1)), match.group(2)
        claimed = _layer_mapping(chunk, suffix, chunk.decoder.layers[local].layer_number - 1,
                                 naming)
        return None if claimed is None else _Mapping(*claimed)
    if name.startswith("mtp."):  # the trained MTP layer (models.layers.mtp.mapping)
        claimed = mtp_mapping(name, hf_config,
                              lambda suffix, layer: _layer_mapping(chunk, suffix, layer, naming))
        return None if claimed is None else _Mapping(*claimed)
    if name in _TOP_MAP:
        kind, names = _TOP_MAP[name]
        if name == "output_layer.weight" and tied:
            names = ("model.embed_tokens.weight",)
        return _Mapping(kind, names)
    return None


def _layer_mapping(chunk, suffix: str, layer: int, naming: ExpertNaming | None
                   ) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a decoder-layer parameter suffix at global layer `layer`."""
    claimed = kinds.claim(suffix, layer, chunk.config, naming)  # the layer kinds' own
    if claimed is not None:
        return claimed
    if suffix not in _LAYER_MAP:
        return None
    kind, names = _LAYER_MAP[suffix]
    return kind, tuple(f"model.layers.{layer}.{n}" for n in names)


def _weights(model) -> list:
    """(name, tensor) of every parameter of a chunk and of the buffers that hold HF weights
    (the sigmoid routers' expert bias: models.layers.sigmoid_routing.mapping)."""
    return list(model.named_parameters()) + mapped_buffers(model)


def _tp():
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _local_shard(kind: str, hf: list[torch.Tensor], cfg: dict, padded_vocab: int) -> torch.Tensor:
    tp, rank = _tp()
    if kind == "replicated":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    if kind in ("heads", "column"):
        return hf[0].chunk(tp, dim=0)[rank]
    if kind == "vocab":
        return wm.pad_vocab(hf[0], padded_vocab).chunk(tp, dim=0)[rank]
    if kind == "qkv":
        heads = cfg["num_attention_heads"]
        fused = wm.merge_qkv(*hf, heads, cfg.get("num_key_value_heads") or heads)
        return fused.chunk(tp, dim=0)[rank]
    if kind == "fc1":
        return wm.merge_gate_up(hf[0], hf[1], tp)[rank]
    if kind in kinds.OWNER:
        return kinds.OWNER[kind].shard(kind, hf, cfg, tp, rank)
    raise ValueError(f"unknown mapping kind {kind}")


def _tied(cfg: dict) -> bool:
    return bool(cfg.get("tie_word_embeddings", False))


def load_hf_weights(chunks: list, reader, hf_config: dict,
                    progress: Callable[[int], None] | None = None) -> int:
    """Copy HF weights into every parameter of `chunks` (this rank's shards). Returns the number
    of parameters filled. Raises, before copying anything, UnsupportedConfigError when the
    config does not map exactly and UnmappedTensorsError when the checkpoint's tensors are not
    exactly the ones the mapping consumes (none dropped, none missing); afterwards, if a
    parameter has no HF source or shapes disagree."""
    check_config(hf_config)
    reader = DequantizingReader(reader, hf_config)  # quantized weights: models.formats.quantized
    check_tensors(hf_config, reader.keys())
    check_shared_copies(hf_config, reader)
    reader = fused_expert_reader(hf_config, reader)  # gpt-oss: per-expert views of fused
    shape = model_shape(hf_config)
    naming = expert_naming(hf_config)
    filled = 0
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in _weights(model):
            mapping = _mapping(model, name, _tied(hf_config), naming, hf_config)
            if mapping is None and is_adapter_param(name):
                continue   # LoRA adapters: initialised by models.lora.sites, not from HF
            if mapping is None:
                raise KeyError(f"megatron parameter {name!r} has no HF mapping")
            tensors = [reader.get(n) for n in mapping.hf_names]
            local = _local_shard(mapping.kind, tensors, hf_config, shape.padded_vocab_size)
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF gives shape {tuple(local.shape)}, megatron expects "
                                 f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
            filled += 1
            if progress:
                progress(1)
    return filled


def check_tensors(hf_config: dict, names) -> None:
    """Raise UnmappedTensorsError unless `names` are exactly the HF tensors the mapping reads."""
    names = list(names)
    problems = tensor_problems(hf_config, names) + tower_tensor_problems(hf_config, names)
    if problems:
        raise UnmappedTensorsError("; ".join(problems))


def check_shared_copies(hf_config: dict, reader) -> None:
    """Raise UnmappedTensorsError unless a trained MTP layer's copies of the embedding and
    output head (models.layers.mtp.mapping.shared_copies) equal the main tensors: the MTP
    layer shares them, a different copy would be dropped."""
    for copy, main in shared_copies(hf_config).items():
        if not torch.equal(reader.get(copy), reader.get(main)):
            raise UnmappedTensorsError(
                f"{copy} differs from {main}: the trained MTP layer shares the model's "
                "embedding and output head (model.mtp.enabled=true); a different copy would "
                "be dropped. Set model.mtp.enabled=false to carry the MTP layer unchanged")


def _gather_tp(tensor: torch.Tensor, dim: int) -> list[torch.Tensor]:
    tp, _ = _tp()
    if tp == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return parts


def export_hf_weights(chunks: list, hf_config: dict, transform: Callable | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight held by this pipeline stage.
    `transform(model, name, param)` gives the local tensor to export instead of the parameter
    (models.lora.sites.merged_weight: LoRA merged into the base).

    Collective over the TP group, and for MoE models over the expert-parallel x expert-TP
    group too (experts are gathered from every EP rank: every rank of a pipeline stage must
    iterate it together). The tied output layer is skipped (HF has no lm_head then); padded
    vocab rows are removed; gpt-oss experts are fused per layer as on disk
    (models.layers.biased_experts.fused)."""
    return fuse_experts(hf_config, _export_stage(chunks, hf_config, transform))


def _export_stage(chunks: list, hf_config: dict, transform: Callable | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights before gpt-oss's expert fusion: experts one tensor each."""
    shape = model_shape(hf_config)
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    tied = _tied(hf_config)
    naming = expert_naming(hf_config)
    seen: set[str] = set()
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in _weights(model):
            mapping = _mapping(model, name, tied, naming, hf_config)
            if mapping is None or (tied and name == "output_layer.weight"):
                continue
            if name == _EMBEDDING and not model.pre_process:  # the MTP stage's copy
                mapping = _Mapping(mapping.kind, ())
            if mapping.hf_names and mapping.hf_names[0] in seen:  # TE/local aliases of a norm
                continue
            data = param.detach() if transform is None else transform(model, name, param)
            kind = mapping.kind
            if kind in kinds.OWNER:  # a layer kind's own gather (models.bridge.kinds)
                pairs = kinds.OWNER[kind].export(kind, data, mapping.hf_names, hf_config,
                                                 model.config, _gather_tp)
            else:
                pairs = zip(mapping.hf_names, _export_generic(kind, data, shape.vocab_size,
                                                              heads, kv_heads))
            for hf_name, tensor in pairs:
                seen.add(hf_name)
                yield hf_name, tensor.contiguous()
            if getattr(model, "mtp_process", False) and name in _SHARED_SOURCES:
                yield from _mtp_copies(hf_config, name, data, shape.vocab_size)


_EMBEDDING = "embedding.word_embeddings.weight"
_SHARED_SOURCES = (_EMBEDDING, "output_layer.weight")


def _mtp_copies(hf_config: dict, name: str, data: torch.Tensor, vocab_size: int
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP layer's copies (models.layers.mtp.mapping.shared_copies) of the embedding or
    output head shard `data` of megatron parameter `name`, on the stage holding the MTP block."""
    main = "model.embed_tokens.weight" if name == _EMBEDDING else "lm_head.weight"
    copies = [c for c, m in shared_copies(hf_config).items() if m == main]
    if copies:
        full = wm.unpad_vocab(torch.cat(_gather_tp(data, 0), 0), vocab_size).contiguous()
        for copy in copies:
            yield copy, full


def _export_generic(kind: str, data: torch.Tensor, vocab_size: int, heads: int, kv_heads: int
                    ) -> list[torch.Tensor]:
    """Full HF tensors of a generic-kind parameter shard (gathered over the TP group)."""
    if kind == "replicated":
        return [data]
    if kind == "row":
        return [torch.cat(_gather_tp(data, 1), dim=1)]
    if kind in ("heads", "column"):
        return [torch.cat(_gather_tp(data, 0), dim=0)]
    if kind == "vocab":
        return [wm.unpad_vocab(torch.cat(_gather_tp(data, 0), 0), vocab_size)]
    if kind == "qkv":
        return list(wm.split_qkv(torch.cat(_gather_tp(data, 0), 0), heads, kv_heads))
    if kind == "fc1":
        return list(wm.split_gate_up(_gather_tp(data, 0)))
    raise ValueError(f"unknown mapping kind {kind}")
