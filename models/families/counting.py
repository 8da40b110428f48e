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
    """(experts per layer, experts per token, parameters of one expert); zeros when dense."""
    fam = moe_family(hf)
    if fam is None:
        return 0, 0, 0
    return (fam.num_experts(hf), fam.experts_per_token(hf),
            3 * field(hf, "hidden_size") * fam.expert_width(hf))


def _layer_parameters(hf: Any) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one decoder layer, experts excluded (a MoE
    layer's replicated part includes its router)."""
    fam = family_of(hf)
    b = fam.biases(hf)
    experts, _, _ = _experts(hf)
    h = field(hf, "hidden_size")
    ffn = 0 if experts else field(hf, "intermediate_size")
    heads = field(hf, "num_attention_heads")
    kv = field(hf, "num_key_value_heads", heads)
    hd = head_dim(hf)
    q_dim, kv_dim = heads * hd, kv * hd
    sharded = 2 * h * q_dim + 2 * h * kv_dim + 3 * h * ffn
    replicated = 2 * h + (2 * hd if fam.qk_norm else 0) + experts * h
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
    stage; `active` and `expert_stage` as in StageParams."""
    sharded, replicated = _layer_parameters(hf)
    experts, topk, per_expert = _experts(hf)
    h = field(hf, "hidden_size")
    layers = field(hf, "num_hidden_layers")
    vocab = field(hf, "vocab_size")
    tied = bool(field(hf, "tie_word_embeddings", False))
    embedding = padded_vocab_size(vocab, tp) * h // tp
    # tied weights with pp > 1: the last stage allocates its own copy of the shared matrix
    output = embedding if (not tied or pp > 1) else 0
    per_stage = layers // pp
    expert_stage = per_stage * (experts // ep) * per_expert // tp
    body = per_stage * (sharded // tp + replicated) + expert_stage
    if pp == 1:
        first = last = body + embedding + output + h
    else:
        first, last = body + embedding, body + output + h
    rest = layers * (sharded + replicated) + vocab * h * (1 if tied else 2) + h
    return StageParams(rest + layers * experts * per_expert, first, last, per_stage,
                       active=rest + layers * topk * per_expert, expert_stage=expert_stage)
