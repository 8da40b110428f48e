"""The Tinker service's Megatron backend: the base model built by Megatron-Core at this
process's layout (tensor parallelism with or without sequence parallelism, Ulysses context
parallelism, data-parallel replicas), every user's adapter a models.lora.tenants adapter (the
engine's own LoRA on megatron's TP-sharded linears), each batch row taking its own.

`MegatronLora` answers what engine.tinker.compute asks of a backend's model (the interface of
engine.tinker.lora.MultiLora): adapters added, loaded, removed and exported as full HF
tensors, and `logits(ids, names, lengths)` -> float32 [b, s, vocab] on every rank of the
replica, differentiable. The sequence is right-padded to a multiple of 2 x cp (with context
parallelism) times tp (with sequence parallelism); causal attention: the real positions do
not change, and the padded ones are dropped. With context parallelism each CP rank runs its
zigzag shard of every row (parallel.zigzag; the attention's all-to-all sees the whole
sequence, parallel.ulysses) and the vocab-gathered logits are gathered over CP (megatron's
sequence gather with tensor_parallel_output_grad=False: every CP rank then computes the same
losses, so the backward keeps each rank's own part of the gradient, unsummed); the adapters'
gradients, each CP rank's from its own tokens, are summed over the CP group
(engine.tinker.mcore_ranks)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region)

from engine.tinker.lora import LORA_ALPHA, LoraSpec, initial_tensors
from models.bridge.weights import load_hf_weights
from models.build.factory import build_model_chunks
from models.hf.io import SafetensorsReader, read_config
from models.lora.slices import LoraSpec as MegatronSpec
from models.lora.tenants import TenantLora
from parallel import cpu_runtime, zigzag

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
        self.cp, self.cp_rank = ps.get_context_parallel_world_size(), \
            ps.get_context_parallel_rank()
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
        step = (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sequence_parallel else 1)
        s = -(-real // step) * step
        tokens = torch.zeros(b, s, dtype=torch.long, device=dev)
        tokens[:, :real] = ids.to(dev)
        positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1)
        if self.cp > 1:   # this rank's zigzag shard of every row (parallel.zigzag)
            tokens, positions = (zigzag.shard(x, [s], self.cp, self.cp_rank)
                                 for x in (tokens, positions))
        self.tenants.assign(names, dev)
        try:
            local = self.model(tokens, positions, None)
        finally:
            self.tenants.assign(None, dev)
        full = gather_from_tensor_model_parallel_region(local)
        if self.cp > 1:   # every CP rank computes the same losses: the backward splits
            full = gather_from_sequence_parallel_region(
                full.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False,
                group=ps.get_context_parallel_group()).transpose(0, 1).index_select(
                1, zigzag.gathered_to_natural([s], self.cp).to(full.device))
        return full[:, :real, :self.vocab].float()
