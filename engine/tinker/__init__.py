"""The Tinker training service (`megatron-sft-engine tinker`, docs/tinker.md): the official
`tinker` SDK's REST API over one base model shared by many users' LoRA adapters.

    lora      per-row multi-LoRA on the HF base model's linears (each batch row its adapter)
    losses    cross_entropy, importance_sampling, ppo, cispo, dro on per-token log-probs
    wire      the SDK's protobuf bodies (forward_backward in; outputs and samples out)
    compute   batched forward/backward, AdamW step, sampling, prompt log-probs
    service   registry with owners, futures, the work queue and its batching worker, state files
    routes    the HTTP routes (FastAPI) and their 4xx refusals"""
