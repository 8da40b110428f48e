"""The Tinker service's Megatron backend: the base model built by Megatron-Core at this
process's layout (tensor parallelism with or without sequence parallelism, data-parallel
replicas), every user's adapter a models.lora.tenants adapter (the engine's own LoRA on
megatron's TP-sharded linears), each batch row taking its own.

`MegatronLora` answers what engine.tinker.compute asks of a backend's model (the interface of
engine.tinker.lora.MultiLora): adapters added, loaded, removed and exported as full HF
tensors, and `logits(ids, names, lengths)` -> float32 [b, s, vocab] on every rank of the
replica (megatron's vocab-parallel logits gathered over TP, differentiable). Under sequence
parallelism the sequence is right-padded to a multiple of tp (causal attention: the real
positions do not change); the padded positions are dropped."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from engine.tinker.lora import LORA_ALPHA, LoraSpec, initial_tensors
from models.bridge.weights import load_hf_weights
from models.build.factory import build_model_chunks
from models.hf.io import SafetensorsReader, read_config
from models.lora.slices import LoraSpec as MegatronSpec
from models.lora.tenants import TenantLora
from parallel import cpu_runtime

def megatron_spec(spec: LoraSpec) -> MegatronSpec:
    """A Tinker LoraConfig as models.lora's spec: its targets, rank, alpha LORA_ALPHA."""
    return MegatronSpec(rank=spec.rank, alpha=LORA_ALPHA, targets=frozenset(spec.suffixes()))


class MegatronLora:
    """The base model on this rank with the users' adapters (module docstring)."""

    def __init__(self, model_dir: str, sequence_parallel: bool):
        hf_config = read_config(model_dir)
        chunks = build_model_chunks(hf_config, sequence_parallel=sequence_parallel)
        load_hf_weights(chunks, SafetensorsReader(model_dir), hf_config)
        self.model = chunks[0]
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.sequence_parallel = sequence_parallel
        self.vocab = int(hf_config["vocab_size"])
        self.max_context = int(hf_config.get("max_position_embeddings", 2048))
        self.arch = f"megatron {hf_config.get('architectures', ['GPTModel'])[0]}"
        self.tenants = TenantLora(self.model, self.vocab)
        self.specs: dict[str, LoraSpec] = {}
        self.unadapted_mlp = None   # MoE models are refused by TenantLora

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return self.tenants.shapes

    def add(self, name: str, spec: LoraSpec) -> None:
        self.load(name, spec, initial_tensors(spec, self.shapes))

    def load(self, name: str, spec: LoraSpec, state: dict[str, torch.Tensor]) -> None:
        self.tenants.add(name, megatron_spec(spec), state)
        self.specs[name] = spec

    def remove(self, name: str) -> None:
        self.tenants.remove(name)
        self.specs.pop(name, None)

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        return self.tenants.parameters(name)

    def full(self, name: str, tensors: list[torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
        return self.tenants.full(name, tensors)

    def shards(self, name: str, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.tenants.shards(name, full)

    def logits(self, ids: torch.Tensor, names: list[str | None], lengths: list[int]
               ) -> torch.Tensor:
        dev = cpu_runtime.device()
        b, real = ids.shape
        s = -(-real // self.tp) * self.tp if self.sequence_parallel else real
        tokens = torch.zeros(b, s, dtype=torch.long, device=dev)
        tokens[:, :real] = ids.to(dev)
        positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1)
        self.tenants.assign(names, dev)
        try:
            local = self.model(tokens, positions, None)
        finally:
            self.tenants.assign(None, dev)
        full = gather_from_tensor_model_parallel_region(local)
        return full[:, :real, :self.vocab].float()
