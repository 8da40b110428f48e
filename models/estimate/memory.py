"""Two terms of the per-GPU memory estimate (engine.config.recipe_validation, whose docstring
states the formulas): the kept activations of one layer's token mixer (GQA attention, DeepSeek's
MLA, or the Qwen3.5 hybrids' mean over their Gated DeltaNet and gated attention layers) and the
loss head's logits on the last pipeline stage, chunked (train.loss_chunk_tokens) or not."""
from __future__ import annotations

from models.layers.mla import costs as mla_costs
from models.estimate.counting import padded_vocab_size
from models.layers.gated_delta_net import costs as gdn_costs

# bytes per logit element the chunked head keeps at its backward's peak: about three fp32
# [chunk, V/tp] buffers (the chunk's logits, probabilities, gradient; docs/benchmarks.md)
CHUNK_LOGIT_BYTES = 12


def mixer_bytes(hf: dict, tp: int, s: int, a: int, keep_kv_copy: bool) -> float:
    """Kept bytes per token of one layer's attention (token mixer) on one GPU; `keep_kv_copy`:
    the repeated KV heads of GQA stay (no selective recomputation)."""
    if mla_costs.uses_mla(hf):
        return a * mla_costs.activation_elements(hf, tp, s)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    hd = hf.get("head_dim") or hf["hidden_size"] // heads
    q, kv = heads * hd, kv_heads * hd
    kv_rep = 2 * q if kv_heads < heads and keep_kv_copy else 0
    gqa = a * (q + kv_rep + q + 2 * kv) / tp
    return gdn_costs.mean_mixer_bytes(hf, tp, a, gqa) if gdn_costs.uses_gdn(hf) else gqa


def logits_bytes(hf: dict, tokens: float, tp: int, a: int, chunk: int | None,
                 head_trained: bool = True) -> float:
    """Loss-head bytes on the last stage for `tokens` tokens per GPU: unchunked (`chunk` 0 or
    None) tokens x V/tp x (a + 12); chunked, CHUNK_LOGIT_BYTES x min(chunk, tokens) x V/tp plus,
    for a trained fp32 output weight (a == 4), the fp32 weight-gradient buffer the head returns
    to autograd, V/tp x h x 4 (engine.training.loss_head). A trained bf16 weight's gradient
    goes straight into DDP's fp32 main_grad (counted with the gradients), a frozen one (LoRA)
    has none."""
    vocab = padded_vocab_size(hf["vocab_size"], tp) / tp
    if not chunk:
        return tokens * vocab * (a + 12)
    grad_buffer = vocab * hf["hidden_size"] * 4 if head_trained and a == 4 else 0
    return CHUNK_LOGIT_BYTES * min(chunk, tokens) * vocab + grad_buffer
