"""Keep a frozen model's weights in host memory between its forward passes (`HostOffload`).

Used for the on-policy distillation teacher (`distill.offload`, engine.rl.policy.train_step):
a forward-only model needed once per RL step, whose device memory the policy's update can use
meanwhile. `offload()` copies every parameter of the model chunks to host memory (pinned when
CUDA is available, so the copy back is asynchronous) and leaves each Parameter holding an empty
tensor on its device, which frees the device memory; `reload()` copies the host values back to
the device they came from. The Parameter objects stay the same, so every module keeps working
after a reload; the host copies are never modified, so a reloaded model is bitwise the model
that was offloaded. Buffers (RoPE frequencies, expert biases) stay on the device: they are
small.

Local to each rank (no collective): every rank offloads its own stage and TP/EP shards.
"""
from __future__ import annotations

from typing import Iterable

import torch


class HostOffload:
    """Host copies of the parameters of `chunks` (a frozen model's modules)."""

    def __init__(self, chunks: Iterable[torch.nn.Module]):
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        if any(p.requires_grad for p in self.params):
            raise ValueError("HostOffload holds frozen models only (a parameter requires grad)")
        self.host: list[torch.Tensor] | None = None
        self.devices: list[torch.device] = []

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    def offload(self) -> None:
        """Move every parameter's values to host memory; the device copies are freed."""
        if self.offloaded:
            return
        pin = torch.cuda.is_available()
        self.devices = [p.device for p in self.params]
        self.host = [p.data.to("cpu", copy=True).pin_memory() if pin
                     else p.data.to("cpu", copy=True) for p in self.params]
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def reload(self) -> None:
        """Copy the host values back to each parameter's device (bitwise the offloaded ones)."""
        if not self.offloaded:
            return
        for p, host, device in zip(self.params, self.host, self.devices):
            p.data = host.to(device, non_blocking=True, copy=True)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.host = None

    def host_bytes(self) -> int:
        """Bytes held in host memory now (0 while the model is on its device)."""
        return sum(t.numel() * t.element_size() for t in self.host or ())
