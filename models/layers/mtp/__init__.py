"""Multi-token prediction (MTP) trained with the model (key `model.mtp.enabled`).

DeepSeek-V3's formula, as megatron-core builds it (megatron.core.transformer.
multi_token_prediction) and as GLM-4.5 / DeepSeek-V3 / Kimi-K2 checkpoints store it: for the
position t of a sequence, with h_t the trunk's final (normed) hidden state and e_{t+1} the
embedding of the next token,

    u_t = W_eh [RMSNorm_e(e_{t+1}) ; RMSNorm_h(h_t)]          (eh_proj, [2h] -> [h])
    g_t = TransformerLayer(u)_t                               (one decoder layer, causal)
    p(x_{t+2} | x_<=t+1) = softmax(W_out RMSNorm_f(g_t))      (the shared output head)

The embedding and the output head are the model's own (tied, as megatron and vLLM's drafters
tie them). `spec` builds megatron's MTP block with the family's own layer spec, `layer` gives it
the next tokens from the micro-batch (no in-model roll: exact with packing and context
parallelism), `model` hands its hidden states to the engine's chunked loss head
(engine.training.mtp), `mapping` names the tensors in HF checkpoints.
"""
