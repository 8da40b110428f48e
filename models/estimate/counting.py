"""Parameter counts per pipeline stage and the padded vocabulary, from an HF config (dict or
transformers object) and its family. Plain arithmetic: no torch, megatron or transformers.

MoE layers (any models.families.moe.MoeFamily): each rank holds num_experts / ep experts,
each split over tp (expert-TP = TP); the router is replicated. Expert parameters are counted apart
(`expert_*`): the distributed optimizer shards them over the expert-data-parallel group
(dp x cp / ep ranks) instead of dp x cp."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from models.families.base import field, head_dim
from models.families.registry import family_of, moe_family
from models.layers.gated_delta_net import costs as gdn_costs
from models.layers.mla import costs as mla_costs
from models.estimate.vision import tower_parameters

# (TP-sharded, replicated) parameters of one layer's mixer and its two layer norms, by the
# layer kind a family declares (Family.mixer_of); a kind not listed is counted as GQA.
MIXER_PARAMETERS = {"gated_delta_net": gdn_costs.gdn_parameters,
                    "gated_attention": gdn_costs.gated_attention_parameters,
                    "mla": mla_costs.attention_parameters}

# Vocab rows are padded to a multiple of this (and of tp). For power-of-two tp <= 128 the padded
# size does not depend on the layout, so one distributed checkpoint loads at any TP.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Smallest multiple of lcm(VOCAB_PAD_MULTIPLE, tp) that holds `vocab_size` rows."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


@dataclass
class StageParams:
    """Parameters one TP rank holds on the first and on the last pipeline stage."""

    total: int               # whole model (HF count, unpadded vocab)
    first_stage: int         # every parameter of the rank, experts included
    last_stage: int
    layers_per_stage: int
    active: int = 0          # parameters one token passes through (= total for dense models)
    expert_stage: int = 0    # expert parameters of one rank of any stage (0: dense)


def _experts(hf: Any) -> tuple[int, int, int]:
    """(experts per MoE layer, experts per token, parameters of one expert); zeros when dense."""
    fam = moe_family(hf)
    if fam is None:
        return 0, 0, 0
    return fam.num_experts(hf), fam.experts_per_token(hf), fam.expert_parameters(hf)


def _is_moe_layer(hf: Any, layer: int) -> bool:
    fam = moe_family(hf)
    return fam is not None and fam.is_moe_layer(hf, layer)


def _layer_parameters(hf: Any, layer: int) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of decoder layer `layer`, routed experts excluded
    (a MoE layer's replicated part includes its router, its sharded part its shared experts;
    a dense layer of a MoE family has the dense MLP of intermediate_size)."""
    fam = family_of(hf)
    b = fam.biases(hf)
    sparse = _is_moe_layer(hf, layer)
    experts = _experts(hf)[0] if sparse else 0
    h = field(hf, "hidden_size")
    ffn = moe_family(hf).shared_expert_width(hf) if sparse else field(hf, "intermediate_size")
    heads = field(hf, "num_attention_heads")
    kv = field(hf, "num_key_value_heads", heads)
    hd = head_dim(hf)
    q_dim, kv_dim = heads * hd, kv * hd
    # attention and the layer norms: the layer kind's own count (MIXER_PARAMETERS) or GQA's
    mixer = MIXER_PARAMETERS.get(fam.mixer_of(hf, layer))
    attention = mixer(hf) if mixer else (
        2 * h * q_dim + 2 * h * kv_dim, 2 * h + (2 * hd if fam.has_qk_norm(hf) else 0))
    sharded = attention[0] + 3 * h * ffn
    replicated = attention[1] + experts * h
    extra_sharded, extra_replicated = fam.extra_layer_parameters(hf)
    sharded, replicated = sharded + extra_sharded, replicated + extra_replicated
    if b.qkv:
        sharded += q_dim + 2 * kv_dim
    if b.o_proj:
        replicated += h      # row-parallel bias: whole on every TP rank
    if b.mlp:
        sharded += 2 * ffn   # gate/up biases (column parallel)
        replicated += h      # down_proj bias (row parallel)
    return sharded, replicated


def stage_parameters(hf: Any, tp: int, pp: int, ep: int = 1) -> StageParams:
    """Parameters of the whole model and of one TP (x EP) rank of the first / last pipeline
    stage (each stage holds its own layers: dense and MoE layers counted as they fall);
    `active` as in StageParams, `expert_stage` the largest over the stages."""
    experts, topk, per_expert = _experts(hf)
    h = field(hf, "hidden_size")
    layers = field(hf, "num_hidden_layers")
    vocab = field(hf, "vocab_size")
    tied = bool(field(hf, "tie_word_embeddings", False))
    embedding = padded_vocab_size(vocab, tp) * h // tp
    # tied weights with pp > 1: the last stage allocates its own copy of the shared matrix
    output = embedding if (not tied or pp > 1) else 0
    per_stage = layers // pp
    counts = [_layer_parameters(hf, i) for i in range(layers)]
    sparse = [_is_moe_layer(hf, i) for i in range(layers)]

    def stage(index: int) -> tuple[int, int]:
        """(body without routed experts, routed experts) of one rank of stage `index`."""
        span = range(index * per_stage, (index + 1) * per_stage)
        body = sum(counts[i][0] // tp + counts[i][1] for i in span)
        return body, sum(sparse[i] for i in span) * (experts // ep) * per_expert // tp

    (first_body, first_experts), (last_body, last_experts) = stage(0), stage(pp - 1)
    first, last = first_body + first_experts, last_body + last_experts
    if pp == 1:
        first = last = first + embedding + output + h
    else:
        first, last = first + embedding, last + output + h
    rest = (sum(a + b for a, b in counts) + vocab * h * (1 if tied else 2) + h
            + tower_parameters(hf))   # a vision tower (models.estimate.vision): in the total
    moe_layers = sum(sparse)
    expert_stage = max(stage(i)[1] for i in range(pp))
    return StageParams(rest + moe_layers * experts * per_expert, first, last, per_stage,
                       active=rest + moe_layers * topk * per_expert, expert_stage=expert_stage)


def embedding_output_parameters(hf: Any, tp: int, pp: int) -> tuple[int, int]:
    """Parameters of the embedding, the output layer and the final norm on one TP rank of the
    first / last pipeline stage (as stage_parameters counts them): what Muon leaves to AdamW
    besides the layers' norms and biases (models.estimate.training_memory)."""
    h = field(hf, "hidden_size")
    embedding = padded_vocab_size(field(hf, "vocab_size"), tp) * h // tp
    tied = bool(field(hf, "tie_word_embeddings", False))
    output = embedding if (not tied or pp > 1) else 0
    if pp == 1:
        return (embedding + output + h,) * 2
    return embedding, output + h
