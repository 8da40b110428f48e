"""The gpt-oss MoE block on megatron's local spec: a router with a bias and experts with
biases computing the clamped SwiGLU.

Megatron gives the router and the experts biases only through `add_bias_linear`, which it
refuses with expert-tensor parallelism > 1 (every expert-TP rank would add the down bias to
its partial sum). Here `add_bias_linear` stays off and the modules below hold the biases:

- `BiasedRouter`: megatron's TopKRouter plus `bias` [E] (its gating already adds
  `self.bias`); replicated, tagged `sequence_parallel` like the router weight.
- `BiasedExperts`: models.layers.experts.grouped.GroupedExperts (same `local_experts.{j}` modules and
  checkpoint layout) with `linear_fc1.bias` [2I/etp] (column-parallel like the weight:
  [gate_r; linear_r]) and `linear_fc2.bias` [H] on every local expert. Per token routed to
  expert e with weight p: h = x W1^T + b1; a = clamp-GLU(h) (gate clamped above at the
  limit, linear half to +-limit, act(gate) * (linear + glu_linear_offset)); out =
  (a p) W2^T + b2 p, i.e. HF's (a W2^T + b2) p. The b2 p term enters the expert-TP sum once
  (`_OnceOverExpertTP`): added by expert-TP rank 0 only, while every rank's copy of b2 gets
  the whole gradient (each rank sees the whole output gradient), so the replicas stay equal.
  LoRA adapters of the expert weights join as in GroupedExperts (`_plus_low_rank`); the
  biases stay frozen, as in peft.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter

from models.families.registry import moe_family
from models.layers.experts.grouped import GroupedExperts, grouped_linear
from models.layers.spec import moe_submodules, replace_experts


def has_biased_experts(hf_config: Any) -> bool:
    """True for families whose router and experts carry biases (gpt-oss)."""
    fam = moe_family(hf_config)
    return fam is not None and fam.expert_biases


class BiasedRouter(TopKRouter):
    """TopKRouter with a bias on its logits (HF GptOssTopKRouter: F.linear(x, W, b))."""

    def __init__(self, config, pg_collection=None, **kwargs):
        # kwargs: what a newer megatron-core passes on (0.19: is_mtp_layer)
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        if self.bias is None:
            self.bias = torch.nn.Parameter(torch.zeros(config.num_moe_experts,
                                                       dtype=config.params_dtype))
            setattr(self.bias, "sequence_parallel", config.sequence_parallel)


class _OnceOverExpertTP(torch.autograd.Function):
    """rows [T, H] * probs [T] as the bias term of outputs summed over the expert-TP group:
    forward on rank 0 only; backward gives `rows` the whole gradient on every rank and
    `probs` its share on rank 0 only (the term exists once in the sum)."""

    @staticmethod
    def forward(ctx, rows, probs, first: bool):
        ctx.save_for_backward(rows, probs)
        ctx.first = first
        out = rows * probs.unsqueeze(-1)
        return out if first else torch.zeros_like(out)

    @staticmethod
    def backward(ctx, grad):
        rows, probs = ctx.saved_tensors
        grad_probs = (grad * rows).sum(-1) if ctx.first else torch.zeros_like(probs)
        return grad * probs.unsqueeze(-1), grad_probs, None


def clamped_glu(h: torch.Tensor, config) -> torch.Tensor:
    """megatron's clamped GLU (MLP.forward's glu with activation_func_clamp_value and
    glu_linear_offset), whatever the fusion settings: gpt-oss's clamped SwiGLU."""
    x_glu, x_linear = torch.chunk(h, 2, dim=-1)
    limit = config.activation_func_clamp_value
    if limit is not None:
        x_glu = x_glu.clamp(min=None, max=limit)
        x_linear = x_linear.clamp(min=-limit, max=limit)
    return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


class BiasedExperts(GroupedExperts):
    """GroupedExperts with per-expert fc1/fc2 biases (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for expert in self.local_experts:
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            fc1.bias = torch.nn.Parameter(torch.zeros(fc1.weight.shape[0],
                                                      dtype=fc1.weight.dtype))
            set_tensor_model_parallel_attributes(fc1.bias, True, 0, 2)
            fc2.bias = torch.nn.Parameter(torch.zeros(fc2.weight.shape[0],
                                                      dtype=fc2.weight.dtype))
            for bias in (fc1.bias, fc2.bias):
                setattr(bias, "allreduce", getattr(fc1.weight, "allreduce", True))
        cfg = self.config
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            raise ValueError("gpt-oss experts in fp8/fp4 are not supported")
        if cfg.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input is not supported with expert biases")

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, *args, **kwargs):
        """[T, H] tokens sorted by local expert, counts [E], routing weights [T] ->
        ([T, H], None), as SequentialMLP.forward."""
        experts = list(self.local_experts)
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        counts = tokens_per_expert.to(permuted_local_hidden_states.device)
        fc1 = torch.stack([e.linear_fc1.weight for e in experts])
        fc2 = torch.stack([e.linear_fc2.weight for e in experts])
        b1 = torch.stack([e.linear_fc1.bias for e in experts]).repeat_interleave(counts, dim=0)
        b2 = torch.stack([e.linear_fc2.bias for e in experts]).repeat_interleave(counts, dim=0)
        probs = permuted_probs.to(permuted_local_hidden_states.dtype)
        x = permuted_local_hidden_states
        hidden = self._plus_low_rank(grouped_linear(x, fc1, tokens_per_expert, self.kernel),
                                     x, "linear_fc1", tokens_per_expert) + b1
        hidden = clamped_glu(hidden, self.config) * probs.unsqueeze(-1)
        out = self._plus_low_rank(grouped_linear(hidden, fc2, tokens_per_expert, self.kernel),
                                  hidden, "linear_fc2", tokens_per_expert)
        first = ps.get_expert_tensor_parallel_rank() == 0
        return out + _OnceOverExpertTP.apply(b2, probs, first), None


def biased_moe_spec(layer_spec, hf_config: Any):
    """For gpt-oss a copy of a local-spec MoE layer spec with BiasedRouter and BiasedExperts;
    for other families `layer_spec` itself."""
    if not has_biased_experts(hf_config):
        return layer_spec
    spec = copy.deepcopy(layer_spec)
    moe_submodules(spec).router = BiasedRouter
    replace_experts(spec, (SequentialMLP, GroupedExperts), BiasedExperts)
    return spec
