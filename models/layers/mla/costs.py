"""What multi-latent attention (DeepSeek-V3 family, models.layers.mla.module) costs per token, for the memory
estimate (engine.config.recipe_validation) and the communication plan (models.estimate.comm)
where GQA's formulas would be wrong: MLA keeps compressed latents on sequence shards and moves
expanded keys and values. Plain arithmetic on an HF config (dict or transformers object).

Per token of one layer, n = heads, dn / dr / dv the nope / rope / value head dims, rq / rkv the
q / kv latent ranks (rq = hidden size when q_lora_rank is null: q_proj reads the hidden state),
tp the tensor-parallel size, s = tp with sequence parallelism else 1:

- kept activations (elements): the latents on sequence shards, (2 rq + 2 rkv + dr) / s (down
  projection outputs and their norms; no q latent when q_lora_rank is null), the shared rope
  key gathered over the sequence, dr, and per TP rank the expanded query, key, value and the
  attention output, n (2 (dn + dr) + 2 dv) / tp (GQA's formula: 2 q + 2 kv + repeats);
- the Ulysses CP exchange (elements, forward): query, key, value and output, n (2 (dn + dr) +
  2 dv) / tp, each moved once forward and once backward (keys and values are exchanged
  expanded: the latent is up-projected before attention);
- TP with sequence parallelism (bytes = elements x activation bytes): all-gathers of the q and
  kv latents (forward, and again for the weight gradients), of the rope key (forward) and of the
  output gradient (backward): (2 rq + 2 rkv + dr + h) / tp; reduce-scatters of the output
  (forward) and of the latents' and rope key's input gradients (backward): h + rq + rkv + dr;
  without sequence parallelism the all-reduces of the output (forward) and of the up
  projections' input gradients (backward): h + rq + rkv. The down projections are replicated
  (no communication), their and the latent norms' weight gradients are summed over TP once per
  step (`sp_replicated`).
"""
from __future__ import annotations

from typing import Any

from models.families.base import field
from models.families.registry import family_of, moe_family


def uses_mla(hf: Any) -> bool:
    """True for configs of a family that declares multi-latent attention."""
    return family_of(hf).multi_latent_attention


def attention_parameters(cfg: Any) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one MLA block and the layer norms
    (models.estimate.counting): the up projections and o_proj split over TP; the down projections
    (q_a_proj, kv_a_proj_with_mqa), the latent norms and the layer norms replicated
    (models.layers.mla.module)."""
    h, heads = int(field(cfg, "hidden_size")), int(field(cfg, "num_attention_heads"))
    nope, rope = int(field(cfg, "qk_nope_head_dim")), int(field(cfg, "qk_rope_head_dim"))
    v, kv_rank = int(field(cfg, "v_head_dim")), int(field(cfg, "kv_lora_rank"))
    q_rank = field(cfg, "q_lora_rank")
    q_out = heads * (nope + rope)
    sharded = kv_rank * heads * (nope + v) + heads * v * h
    replicated = 2 * h + h * (kv_rank + rope) + kv_rank
    if q_rank is None:
        sharded += h * q_out
    else:
        sharded += int(q_rank) * q_out
        replicated += h * int(q_rank) + int(q_rank)
    return sharded, replicated



def _dims(hf: Any) -> tuple[int, int, int, int, int, int, int]:
    """(h, n, dn, dr, dv, rq, rkv)."""
    h = int(field(hf, "hidden_size"))
    q_rank = field(hf, "q_lora_rank")
    return (h, int(field(hf, "num_attention_heads")), int(field(hf, "qk_nope_head_dim")),
            int(field(hf, "qk_rope_head_dim")), int(field(hf, "v_head_dim")),
            h if q_rank is None else int(q_rank), int(field(hf, "kv_lora_rank")))


def activation_elements(hf: Any, tp: int, s: int) -> float:
    """Kept attention activations per token of one layer (module docstring)."""
    _, n, dn, dr, dv, rq, rkv = _dims(hf)
    latent_q = 0 if field(hf, "q_lora_rank") is None else 2 * rq
    return (latent_q + 2 * rkv + dr) / s + dr + n * (2 * (dn + dr) + 2 * dv) / tp


def exchange_elements(hf: Any, tp: int) -> float:
    """Elements per token one CP rank hands to the Ulysses exchange, forward, per layer."""
    _, n, dn, dr, dv, _, _ = _dims(hf)
    return n * (2 * (dn + dr) + 2 * dv) / tp


def tp_elements(hf: Any, tp: int, sp: bool) -> tuple[float, float]:
    """(elements per token handed to TP collectives by one layer's attention in forward and
    backward, in forward alone) (module docstring)."""
    h, _, _, dr, _, rq, rkv = _dims(hf)
    if not sp:
        return h + rq + rkv, h
    gathers = (2 * rq + 2 * rkv + dr + h) / tp
    reduce_scatters = h + rq + rkv + dr
    return gathers + reduce_scatters, (rq + rkv + dr) / tp + h


def sp_replicated(hf: Any) -> int:
    """Sequence-parallel-tagged replicated weights of one layer (summed over TP once per step):
    the layer norms, the latent norms and the replicated down projections."""
    return attention_parameters(hf)[1]


def fp8_weight_shapes(hf: Any) -> list[tuple[tuple[int, int], int]]:
    """[((out, in), how many)] of the decoder weights DeepSeek-V3 / Kimi-K2 publish in FP8
    (each with a `weight_scale_inv` of 128 x 128 blocks): every 2-D linear weight of the
    decoder layers (the MLA projections q_a / q_b or q_proj, kv_a_proj_with_mqa, kv_b, o; the
    dense MLPs; every routed and the shared experts' gate / up / down), not the embeddings,
    lm_head, norms, routers or the score bias. MTP layers are not counted (an engine serves
    them only for speculative decoding)."""
    h, n, dn, dr, dv, rq, rkv = _dims(hf)
    attention = [((rkv + dr, h), 1), ((n * (dn + dv), rkv), 1), ((h, n * dv), 1)]
    attention += ([((n * (dn + dr), h), 1)] if field(hf, "q_lora_rank") is None
                  else [((rq, h), 1), ((n * (dn + dr), rq), 1)])
    moe = moe_family(hf)
    out: list[tuple[tuple[int, int], int]] = []
    for layer in range(int(field(hf, "num_hidden_layers"))):
        if moe is not None and moe.is_moe_layer(hf, layer):
            e, width = moe.num_experts(hf), moe.expert_width(hf)
            shared = moe.shared_expert_width(hf)
            mlp = [((width, h), 2 * e), ((h, width), e)]
            mlp += [((shared, h), 2), ((h, shared), 1)] if shared else []
        else:
            ffn = int(field(hf, "intermediate_size"))
            mlp = [((ffn, h), 2), ((h, ffn), 1)]
        out += attention + mlp
    return out
