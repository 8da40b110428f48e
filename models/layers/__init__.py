"""Layer kinds: one package per kind, holding what that kind needs everywhere: its megatron
module, its layer spec, its HF <-> Megatron weight mapping and its cost formulas.

- `attention/`: SDPA core attention, attention sinks and sliding windows, RoPE from HF configs.
- `mla/`: multi-latent attention (module, mapping, costs).
- `gated_delta_net/`: Gated DeltaNet and the gated attention of the hybrids (module, the delta
  rule, per-layer spec, mapping, costs).
- `experts/`: grouped experts, the expert weight mapping, megatron MoE fixes, routing replay.
- `biased_experts/`: a router and experts with biases, the clamped SwiGLU, fused expert tensors.
- `sigmoid_routing/`: dense-then-MoE stacks and the sigmoid router's bias and shared experts.
- `norms/`, `heads/`: local-spec norms (plain and zero-centred), output and value heads.
- `spec.py` (the local / Transformer Engine spec choice) and `transforms.py` (the tensor
  transforms shared by every mapping) sit beside the kinds.

A layer kind reads the facts a family declares (models.families.base) through the registry; it
never branches on a model_type. Adding a kind: its package here, and one row in the table that
uses it (models.bridge.weights.LAYER_KINDS for a mapping, models.estimate.counting for a count).

May import: models.hf (config objects), models.families, models.families.base, parallel.
"""
