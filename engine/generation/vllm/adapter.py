"""The adapter sync of a vLLM engine (rollout.vllm.lora_sync=adapter; engine.generation
.vllm.lora decides it, engine.generation.vllm.backend owns one `AdapterSync`).

The engine loaded model.hf_path with vLLM's LoRA enabled (AdapterServing.engine_args) and its
base weights are never written again. A sync is a run of `take` calls, one per bucket of the
trainer's adapter tensors in peft's names (models.lora.peft.export_peft_tensors, streamed by
the ordinary weight sync), then `close` (the engine's next generate or probe): the adapter is
written as a peft folder (models.lora.peft.write_peft_adapter: adapter_config.json with the
run's rank, alpha, rsLoRA and patterns, adapter_model.safetensors), on /dev/shm where it has
room (engine.generation.sync.bucket_files.bucket_dir), loaded by every worker of the engine through
vLLM's `add_lora` under a new LoRARequest (id = policy version served by this engine, name
`policy-<id>`), the previous version removed, and the folder deleted. Every generate then
carries `request`.

Refused, never served: a tensor that is not one of the adapter's (a base weight: the base
stays model.hf_path), and a sync that did not bring every adapter tensor (`close` returns the
missing names; the engine refuses to sample until a complete sync).
"""
from __future__ import annotations

import shutil
import tempfile
from typing import Iterable

import torch

from engine.generation.sync.bucket_files import bucket_dir
from engine.generation.vllm.lora import AdapterServing
from models.lora.peft import write_peft_adapter


class AdapterSync:
    """The adapter versions of one engine (`llm`: its vllm.LLM) of the base at `base_path`."""

    def __init__(self, llm, serving: AdapterServing, base_path: str) -> None:
        self.llm, self.serving, self.base_path = llm, serving, base_path
        self.pending: dict[str, torch.Tensor] = {}
        self.version = 0
        self.request = None   # the LoRARequest every generate carries (None: no sync yet)

    def take(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep one bucket of adapter tensors (host copies: the trainer's may be its
        parameters, which the next optimizer step changes)."""
        bucket = list(bucket)
        foreign = [name for name, _ in bucket if name not in self.serving.names]
        if foreign:
            raise ValueError(f"update_weights: {foreign[:3]} are not tensors of the policy's "
                             "adapter; with rollout.vllm.lora_sync=adapter the engine's base "
                             "stays model.hf_path and only the adapters are synced")
        for name, tensor in bucket:
            self.pending[name] = tensor.detach().to("cpu", copy=True)

    def close(self) -> list[str]:
        """Serve the taken tensors as the next adapter version; the adapter tensors the sync
        left out (then nothing is served: the engine refuses to sample)."""
        taken, self.pending = self.pending, {}
        missing = sorted(self.serving.names - set(taken))
        if missing:
            return missing
        from vllm.lora.request import LoRARequest   # vLLM, imported by the engine's owner only
        nbytes = sum(t.numel() * t.element_size() for t in taken.values())
        folder = tempfile.mkdtemp(prefix="rl_adapter_", dir=bucket_dir(nbytes))
        try:
            write_peft_adapter(taken, self.serving.spec, self.base_path, folder)
            request = LoRARequest(f"policy-{self.version + 1}", self.version + 1, folder)
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter of {request.lora_name}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.version += 1
        if self.request is not None:
            self.llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request = request
        return []
