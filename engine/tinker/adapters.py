"""The users' adapters with their AdamW states on one replica of the Tinker service's model:
every model operation the service runs (engine.tinker.service), one method each, on either
backend (`lora`: engine.tinker.lora.MultiLora or engine.tinker.mcore.MegatronLora; `ranks`:
engine.tinker.ranks). On several ranks the root's calls are mirrored on every other rank
(engine.tinker.lockstep), so every method takes only plain, picklable arguments and returns
its result on the root; `sample` runs on the root alone, on its sampler (engine.tinker
.samplers: the engine's hf or vllm generation backend), which holds the samplers' adapters.

A state (save_state, a sampler's weights) is layout- and backend-independent: {"adapter":
{path.A / path.B: full HF tensor}, "adam": {"step", "exp_avg": {key: tensor}, "exp_avg_sq":
{key: tensor}} or None}, the moments keyed like the adapter."""
from __future__ import annotations

import torch

from engine.tinker.compute import adam_step, run_losses
from engine.tinker.lora import LoraSpec


class Adapters:
    def __init__(self, lora, ranks, sampler):
        """`sampler`: the root's sampler (engine.tinker.samplers.make_sampler: the hf
        sampler, on the hf backend over `lora` itself, or vLLM's), None on the other ranks."""
        self.lora, self.ranks, self.sampler = lora, ranks, sampler
        self.optimizers: dict[str, torch.optim.AdamW] = {}

    def create(self, adapter: str, spec: LoraSpec, state: dict | None = None) -> None:
        """A trainable adapter: new (peft's initialisation from spec.seed) or from `state`,
        with its AdamW state where `state` has one."""
        if state is None:
            self.lora.add(adapter, spec)
        else:
            self.lora.load(adapter, spec, state["adapter"])
        params = self.lora.parameters(adapter)
        optimizer = torch.optim.AdamW(params, lr=0.0)
        adam = state.get("adam") if state is not None else None
        if adam is not None:
            moments = zip(self.lora.shards(adapter, adam["exp_avg"]),
                          self.lora.shards(adapter, adam["exp_avg_sq"]))
            for p, (m, v) in zip(params, moments):
                optimizer.state[p] = {"step": torch.tensor(float(adam["step"])),
                                      "exp_avg": m.to(p.device), "exp_avg_sq": v.to(p.device)}
        self.optimizers[adapter] = optimizer

    def frozen(self, adapter: str, spec: LoraSpec, state: dict | None = None,
               source: str | None = None) -> None:
        """A sampler's adapter on the root's sampler, without gradients: `source`'s current
        weights (their export is collective over TP), or `state`'s."""
        tensors = self.lora.full(source) if state is None else state["adapter"]
        if self.sampler is not None:
            self.sampler.load(adapter, spec, tensors)

    def release(self, adapter: str) -> None:
        """On the root only: the sampler drops a sampler's adapter (its memory freed)."""
        if self.sampler is not None:
            self.sampler.unload(adapter)

    def remove(self, adapter: str) -> None:
        self.lora.remove(adapter)
        self.optimizers.pop(adapter, None)

    def run_losses(self, items: list[dict], grad: bool) -> list[dict] | None:
        return run_losses(self.lora, items, grad, self.ranks)

    def optim_step(self, adapter: str, adam: dict) -> dict:
        return adam_step(self.lora.parameters(adapter), self.optimizers[adapter], adam,
                         self.ranks)

    def export(self, adapter: str, with_optimizer: bool) -> dict:
        """The adapter's state (module docstring); collective over TP."""
        out = {"adapter": _on_cpu(self.lora.full(adapter)), "adam": None}
        params = self.lora.parameters(adapter)
        states = [self.optimizers[adapter].state.get(p) for p in params]
        if with_optimizer and states and all(states):
            out["adam"] = {"step": int(states[0]["step"]), **{
                k: _on_cpu(self.lora.full(adapter, [s[k] for s in states]))
                for k in ("exp_avg", "exp_avg_sq")}}
        return out

    def sample(self, requests: list[dict]) -> list[tuple[list, list | None]]:
        """On the root only (its sampler's `sample`: engine.tinker.sampler.sample_on's
        requests, each with its adapter)."""
        return self.sampler.sample(requests)


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state's tensors in host memory (a state file loads on any host)."""
    return {k: v.detach().cpu() for k, v in tensors.items()}
