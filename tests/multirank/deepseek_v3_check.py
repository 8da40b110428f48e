"""DeepSeek-V3 (MLA) checks on the rank pool (run by tests/test_deepseek_v3.py; the SFT
invariance itself runs tests/multirank/glm4_moe_check.py, the sigmoid-routing harness, on the
tiny DeepSeek-V3 folders).

1. `logits_parity(model_dir)` (one rank): the megatron model built from a tiny HF folder gives
   transformers' fp32 logits. Negative controls on the same weights: megatron's own MLA softmax
   scale without YaRN's mscale_all_dim (`no_mscale`), the latent norms with rms_norm_eps
   instead of HF's 1e-6 (`norm_eps`, run with a config whose rms_norm_eps differs), and, for a
   rope_interleave=false model, its rope rows loaded unpermuted (`no_permute`).
2. `mla_tp_sp(model_dir)` (two ranks): one MLA layer of the folder at TP2 + sequence
   parallelism gives the single-rank output and parameter gradients (summed over TP where
   megatron sums them); negative control: megatron's local spec as it comes, whose
   column-parallel down projections lose the other TP rank's share of the shared rope key's
   gradient.
Each returns a dict of maximum differences (relative for the TP check).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _tokens(cfg: dict) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))


def _build(cfg: dict, model_dir: str):
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader

    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, SafetensorsReader(model_dir), cfg)
    for chunk in chunks:
        chunk.eval()
    return chunks


def _attention_modules(chunks) -> list:
    from models.layers.mla.module import HFMultiLatentAttention
    return [m for c in chunks for m in c.modules() if isinstance(m, HFMultiLatentAttention)]


def logits_parity(model_dir: str) -> dict:
    """{"max_abs", "scale", "no_mscale", "norm_eps", "no_permute"} (module docstring)."""
    from transformers import AutoModelForCausalLM

    from models.layers.mla import mapping as mla_mapping
    from models.build.forward import forward_logits
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel, teardown_model_parallel

    cfg = read_config(model_dir)
    setup_model_parallel(ParallelLayout(1))
    tokens, vocab = _tokens(cfg), cfg["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    chunks = _build(cfg, model_dir)
    out = {"max_abs": float((forward_logits(chunks, tokens, vocab) - ref).abs().max()),
           "scale": float(ref.abs().max())}
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    for attention in _attention_modules(chunks):
        attention.core_attention.scale = qk ** -0.5
    out["no_mscale"] = float((forward_logits(chunks, tokens, vocab) - ref).abs().max())
    teardown_model_parallel()
    setup_model_parallel(ParallelLayout(1))
    chunks = _build(dict(cfg, rms_norm_eps=0.1), model_dir)   # latent norms follow the eps
    for attention in _attention_modules(chunks):
        for norm in (getattr(attention, "q_layernorm", None), attention.kv_layernorm):
            if norm is not None:
                norm.eps = 0.1
    bug = forward_logits(chunks, tokens, vocab)
    hf.config.rms_norm_eps = 0.1
    for module in hf.modules():   # HF's layer norms with the same eps, latent norms 1e-6
        if type(module).__name__ == "DeepseekV3RMSNorm" and module.weight.numel() == cfg[
                "hidden_size"]:
            module.variance_epsilon = 0.1
    with torch.no_grad():
        ref_eps = hf(tokens).logits.float()
    out["norm_eps"] = float((bug - ref_eps).abs().max())
    if cfg.get("rope_interleave", True) is False:
        teardown_model_parallel()
        setup_model_parallel(ParallelLayout(1))
        original = mla_mapping.rope_order
        mla_mapping.rope_order = lambda dim, interleaved: torch.arange(dim)
        try:
            chunks = _build(cfg, model_dir)
        finally:
            mla_mapping.rope_order = original
        out["no_permute"] = float((forward_logits(chunks, tokens, vocab) - ref).abs().max())
    return out


def _layer(cfg: dict, local_spec: bool):
    """Layer 0's MLA attention module of `cfg` under the current parallel state, with the
    folder's weights (this TP rank's shards). `local_spec`: megatron's spec as it comes."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from models.build.transformer_config import transformer_config
    from models.layers.attention.core import SDPACoreAttention
    from models.layers.mla import module as mla

    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    config = transformer_config(cfg, tp=tp, sequence_parallel=tp > 1)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    spec = mla.hf_mla_layer_spec(spec, cfg)
    if local_spec:
        from megatron.core.tensor_parallel import ColumnParallelLinear
        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = ColumnParallelLinear
        attention.linear_kv_down_proj = ColumnParallelLinear
    return build_module(spec.submodules.self_attention, config=config, layer_number=1)


def _load_layer(module, model_dir: str, cfg: dict) -> None:
    """The folder's layer-0 attention weights, this TP rank's part (the bridge's slicing; a
    column-parallel down projection of the control takes its rows chunk)."""
    from megatron.core import parallel_state as ps

    from models.bridge.weights import _local_shard  # noqa: PLC2701 (the bridge's own TP slicing)
    from models.hf.io import SafetensorsReader
    from models.layers.mla.mapping import mla_mapping

    reader = SafetensorsReader(model_dir)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "linear_proj.weight":
                kind, names = "row", ("model.layers.0.self_attn.o_proj.weight",)
            else:
                kind, names = mla_mapping("self_attention." + name, 0, module.config)
            local = _local_shard(kind, [reader.get(n) for n in names], cfg, 0)
            if local.shape != p.shape:
                local = local.chunk(tp, 0)[rank]
            p.copy_(local)


def _run_layer(module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(full output, {param: full-shape grad, summed over TP where finalize_model_grads sums
    it}) of a weighted sum of the outputs; `x` [s, b, h], split over TP along s with SP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group()
    module.zero_grad()
    local = x.chunk(tp, 0)[rank].detach().requires_grad_(True)
    out, _ = module(local, None)
    weights = torch.linspace(0.5, 1.5, x.shape[0] * out[0].numel()).reshape(
        x.shape[0], *out.shape[1:])
    (out * weights.chunk(tp, 0)[rank]).sum().backward()
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.detach().contiguous(), group=group)
    grads = {}
    for name, p in module.named_parameters():
        g = p.grad.detach().clone()
        if tp > 1 and getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=group)
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            shards = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(shards, g.contiguous(), group=group)
            g = torch.cat(shards, dim=p.partition_dim)
        grads[name] = g
    return torch.cat(parts, dim=0), grads


def mla_tp_sp(model_dir: str) -> dict:
    """{"out_rel", "grad_rel", "control_grad_rel"} of layer 0 at TP2 + SP vs one rank."""
    from models.build.factory import _tag_tensor_parallel_params  # noqa: PLC2701
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel, teardown_model_parallel

    cfg = read_config(model_dir)
    x = torch.randn(16, 2, cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    results = {}
    for tp, control in ((1, False), (2, False), (2, True)):
        teardown_model_parallel()
        setup_model_parallel(ParallelLayout(2, tp=tp))
        module = _layer(cfg, control)
        _tag_tensor_parallel_params(module)
        _load_layer(module, model_dir, cfg)
        results[(tp, control)] = _run_layer(module, x)
    (ref_out, ref_grads) = results[(1, False)]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))

    out, grads = results[(2, False)]
    _, control = results[(2, True)]
    return {"out_rel": rel(out, ref_out),
            "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            "control_grad_rel": max(rel(control[n], ref_grads[n]) for n in ref_grads)}
