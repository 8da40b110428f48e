"""Model FLOPs and parameter counts of an HF config for the benchmarks' MFU (tools.bench.gpu_sft's
cases and tools.bench.peer): 3 x forward per step; forward = 2 x (weights used per token, LM head
included, embedding lookup not) x tokens + causal attention 2 x 2 x q_dim x L(L+1)/2 per layer
and sequence; for MoE the weights used per token are the attention, the router and the top-k
routed plus the shared experts (GLM-4.5 / DeepSeek-V3: dense before first_k_dense_replace);
trained MTP layers count as decoder layers plus eh_proj and a second head pass."""
from __future__ import annotations


def experts(hf: dict) -> int:
    """Routed experts of an HF config (transformers 5 saves num_local_experts; GLM-4.5 and
    DeepSeek-V3 n_routed_experts), 0 if dense."""
    return int(hf.get("num_experts") or hf.get("num_local_experts")
               or hf.get("n_routed_experts") or 0)


def layer_weights(hf: dict, layer: int) -> tuple[int, int]:
    """(weights, weights used per token) of decoder layer `layer`'s matrices (attention, MLP,
    router; norms not): dense before first_k_dense_replace or without experts, else routed
    experts (top-k used) plus the shared ones."""
    h = hf["hidden_size"]
    q = hf["num_attention_heads"] * hf["head_dim"]
    kv = hf["num_key_value_heads"] * hf["head_dim"]
    attn = h * (q + 2 * kv) + q * h
    n = experts(hf)
    if not n or layer < int(hf.get("first_k_dense_replace") or 0):
        mlp = 3 * h * hf["intermediate_size"]
        return attn + mlp, attn + mlp
    e = 3 * h * hf["moe_intermediate_size"]
    shared = int(hf.get("n_shared_experts") or 0) * e
    return (attn + n * e + shared + h * n,
            attn + hf["num_experts_per_tok"] * e + shared + h * n)


def model_flops(hf: dict, lengths: list[int], mtp_layers: int = 0) -> float:
    """3 x forward FLOPs of one step over sequences of these lengths (see module docstring);
    `mtp_layers` trained MTP layers count as decoder layers plus eh_proj and the head."""
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q = hf["num_attention_heads"] * hf["head_dim"]
    every = range(layers + mtp_layers)
    per_token = (sum(layer_weights(hf, i)[1] for i in every)
                 + (1 + mtp_layers) * h * hf["vocab_size"] + mtp_layers * 2 * h * h)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 3.0 * (2 * per_token * sum(lengths) + len(every) * 2 * 2 * q * pairs)


def param_counts(hf: dict, mtp_layers: int = 0) -> tuple[float, float]:
    """(total parameters, parameters used per token) of the HF config (with `mtp_layers`
    trained MTP layers: their decoder layer, eh_proj and three norms; head and embedding are
    shared)."""
    h, layers, v = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    norms = 2 * hf["head_dim"] + 2 * h
    emb = v * h * (1 if hf.get("tie_word_embeddings") else 2)
    total = active = emb + h
    for i in range(layers + mtp_layers):
        t, a = layer_weights(hf, i)
        extra = norms + (2 * h * h + 3 * h if i >= layers else 0)
        total, active = total + t + extra, active + a + extra
    return total, active
