"""Routed experts of the HF rollout backend (R3 routing replay): forward hooks on the MoE gates.

transformers 5 builds every sparse block of Qwen3-MoE and Mixtral with a router module at
`model.layers.{i}.mlp.gate` (gpt-oss: `mlp.router`) whose forward returns (router_logits,
routing_weights, selected_experts [tokens, k]): the experts the block then runs.
`GateRecorder` keeps the selected experts of every forward call, layer by layer;
`HFRolloutEngine._generate` drains it
after the prefill (tokens = batch x longest prompt, row-major) and after each decode step
(tokens = batch), and `assemble` turns those into one table per response:

    routed_experts [len(prompt) + len(response) - 1, num_layers * k]  (layer-major, int)

the routing of every token the trainer feeds for that response (prompt tokens from the prefill,
response token j from the decode step that consumed it; the last response token is never fed),
the layout of engine.training.routing.ROUTED_EXPERTS.
"""
from __future__ import annotations

import re

import torch

_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:gate|router)$")


class GateRecorder:
    """Hooks on every MoE gate of an HF causal LM (one per MoE decoder layer; a dense layer,
    e.g. GLM-4.5's first_k_dense_replace ones, gets zeros in its columns, which the trainer's
    replay never reads: only MoE layers have a router)."""

    def __init__(self, model):
        gates = {}
        for name, module in model.named_modules():
            match = _GATE.search(name)
            if match and hasattr(module, "top_k"):
                gates[int(match.group(1))] = module
        layers = int(model.config.num_hidden_layers)
        if not gates or not set(gates) <= set(range(layers)):
            raise ValueError(
                f"{type(model).__name__}: routed experts need a top-k router at "
                f"model.layers.{{i}}.mlp.gate of its {layers} layers (transformers 5 "
                f"Qwen3-MoE / Mixtral / GLM-4.5); found {sorted(gates)}")
        self.num_layers = layers
        self.topk = int(next(iter(gates.values())).top_k)
        self._calls: dict[int, list[torch.Tensor]] = {i: [] for i in gates}
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in gates.items()]

    def _hook(self, layer: int):
        def hook(module, inputs, outputs):
            self._calls[layer].append(outputs[2].detach().to(torch.int16).cpu())
        return hook

    def take(self) -> torch.Tensor:
        """The routing of the forward since the last take: [tokens, num_layers * k] int16."""
        routed = {}
        for layer, calls in self._calls.items():
            if len(calls) != 1:
                raise RuntimeError(f"MoE gate of layer {layer} ran {len(calls)} times in one "
                                   "forward (expected once)")
            routed[layer] = calls.pop()
        tokens = next(iter(routed.values())).shape[0]
        dense = torch.zeros(tokens, self.topk, dtype=torch.int16)  # a dense layer: no routing
        return torch.cat([routed.get(i, dense) for i in range(self.num_layers)], dim=1)

    def clear(self) -> None:
        for calls in self._calls.values():
            calls.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def assemble(prompts: list[list[int]], prefill: torch.Tensor, steps: list[torch.Tensor],
             lengths: list[int]) -> list[torch.Tensor]:
    """Per response i: the prefill rows of prompt i (left-padded to the longest prompt) then
    decode step j's row i for j < lengths[i] - 1. `prefill` [batch * longest, width];
    `steps[j]` [batch, width]."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    prefill = prefill.reshape(batch, longest, -1)
    out = []
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        rows = [prefill[i, longest - len(prompt):]]
        rows += [steps[j][i:i + 1] for j in range(n - 1)]
        out.append(torch.cat(rows, dim=0))
    return out
