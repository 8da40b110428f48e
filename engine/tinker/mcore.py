"""The Tinker service's Megatron backend: the base model built by Megatron-Core at this
process's layout (tensor parallelism with or without sequence parallelism, pipeline stages,
Ulysses context parallelism, expert parallelism, data-parallel replicas), every user's adapter a
models.lora.tenants adapter (the engine's own LoRA on megatron's TP-sharded linears) on the
layers of this rank's stage, each batch row taking its own.

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
(engine.tinker.mcore_ranks).

With pipeline parallelism the batch's rows pass the stages in micro-batches
(`micro_batches`: MICRO_BATCHES_PER_STAGE per stage), point-to-point over parallel_state's
PP neighbours: each stage other than the first receives the previous stage's hidden states
[s / cp (/ tp under SP), b, hidden] (pipeline_dtype), runs its layers and sends its own on
without waiting for the receiver (isend), so stage k runs micro-batch j + 1 while stage
k + 1 runs j; `logits` returns the logits on the last stage and None on the others. Once
every micro-batch's forward has run (engine.tinker.compute), `backward(loss)` per
micro-batch, the latest first, runs the stages in reverse: the last from the loss, every
other from the gradient of its output that the next stage sends back (each stage sending the
gradient of its received input), pipelined the same way (GPipe's schedule). Exports
(`full`) and the adapters' shapes are gathered over the PP group, so a state and a seed's
initial adapter are the whole model's at every layout.

A MoE model's experts take no adapter (models.lora.tenants; `unadapted_mlp` says why the
service refuses train_mlp) and may be spread over expert-parallel ranks (megatron's EP
group, carved from the data-parallel replicas): their token all-to-alls are then collective
over replicas that hold different rows, so every replica runs every call's forward and
backward (`every_replica`, engine.tinker.compute) and the embedding's output takes a
gradient, so that every MoE layer's backward all-to-all runs on every rank whatever the
adapters of its rows."""
from __future__ import annotations

import torch
import torch.distributed as dist
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
from parallel.wrappers import unwrap

MICRO_BATCHES_PER_STAGE = 2   # a pipelined call's micro-batches per pipeline stage


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
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.pp = self.pp_group.size()
        self.pipes: list[tuple] = []   # (input, output) of each forward awaiting its backward
        self.sends: list[tuple] = []   # (work, tensor) of this stage's sends in flight
        # under expert parallelism every replica of an EP group runs every call's forward and
        # backward (the experts' all-to-alls are collective; engine.tinker.compute), with
        # gradients through every layer whatever its rows' adapters
        self.every_replica = ps.get_expert_model_parallel_world_size() > 1
        self.vocab = int(hf_config["vocab_size"])
        self.max_context = int(hf_config.get("max_position_embeddings", 2048))
        self.arch = f"megatron {hf_config.get('architectures', ['GPTModel'])[0]}"
        self.tenants = TenantLora(self.model, self.vocab)
        if self.every_replica and self.first:
            unwrap(self.model).embedding.register_forward_hook(_needs_grad)
        self.shapes = {k: v for part in _over_pp(self.tenants.shapes, self.pp_group)
                       for k, v in part.items()}   # {HF path: (out, in)}, the whole model's
        self.specs: dict[str, LoraSpec] = {}
        # why train_mlp cannot be served (None: it can): models.lora.tenants adapts no MoE MLP
        moe = any(part["moe"] for part in _over_pp({"moe": self.tenants.moe}, self.pp_group))
        self.unadapted_mlp = None if not moe else (
            f"{self.arch} has mixture-of-experts MLPs, whose experts this backend's adapters "
            "do not reach")

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
        """Adapter `name`'s full HF tensors (or `tensors`', models.lora.tenants) over every
        stage; collective over TP and PP."""
        mine = self.tenants.full(name, tensors)
        if self.pp == 1:
            return mine
        mine = {k: v.detach().cpu() for k, v in mine.items()}
        return {k: v for part in _over_pp(mine, self.pp_group) for k, v in part.items()}

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
        received = None
        if not self.first:   # the previous stage's hidden states of this rank's positions
            shape = (tokens.shape[1] // (self.tp if self.sequence_parallel else 1), b,
                     self.model.config.hidden_size)
            received = torch.empty(shape, dtype=self.model.config.pipeline_dtype, device=dev)
            dist.recv(received, ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(torch.is_grad_enabled())
            unwrap(self.model).set_input_tensor(received)
        self.tenants.assign(names, dev)
        try:
            local = self.model(tokens, positions, None)
        finally:
            self.tenants.assign(None, dev)
        if torch.is_grad_enabled():
            self.pipes.append((received, local))
        if not self.last:
            self._send(local.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        full = gather_from_tensor_model_parallel_region(local)
        if self.cp > 1:   # every CP rank computes the same losses: the backward splits
            full = gather_from_sequence_parallel_region(
                full.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False,
                group=ps.get_context_parallel_group()).transpose(0, 1).index_select(
                1, zigzag.gathered_to_natural([s], self.cp).to(full.device))
        return full[:, :real, :self.vocab].float()

    def micro_batches(self, rows: int) -> list[tuple[int, int]]:
        """(first, end) row ranges of a call's `rows` (engine.tinker.compute.run_losses): on
        pipeline stages without expert parallelism min(rows, MICRO_BATCHES_PER_STAGE x pp)
        contiguous pieces of as equal row counts as can be, so that every stage works while
        the others do (the forwards' and backwards' sends do not wait for their receivers);
        one piece otherwise. Called at the start of each call: the previous call's sends are
        complete first, and forwards it kept without a backward (a replica with no backward
        row, a call that failed) are dropped."""
        for work, _ in self.sends:
            work.wait()
        self.sends, self.pipes = [], []
        if not rows:
            return []
        m = 1 if self.pp == 1 or self.every_replica else \
            min(rows, MICRO_BATCHES_PER_STAGE * self.pp)
        bounds = [rows * i // m for i in range(m + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def _send(self, tensor: torch.Tensor, rank: int) -> None:
        self.sends.append((dist.isend(tensor, rank), tensor))

    def backward(self, loss: torch.Tensor | None) -> None:
        """The backward of the latest `logits` call whose backward has not run, on every
        stage of this replica (module docstring); `loss`: the last stage's (None
        elsewhere)."""
        pipe = self.pipes.pop()
        if self.last:
            if loss is not None and loss.requires_grad:
                loss.backward()
        else:
            received, output = pipe
            grad = torch.empty_like(output)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            if output.requires_grad:
                torch.autograd.backward(output, grad)
        if not self.first:
            received = pipe[0]
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            self._send(grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())


def _needs_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a tensor that takes a gradient (with grad enabled): every
    MoE layer's all-to-all then runs in the backward on every rank."""
    return output.requires_grad_() if torch.is_grad_enabled() else output


def _over_pp(part: dict, group) -> list[dict]:
    """Every pipeline stage's `part`, in stage order (all_gather_object over `group`)."""
    if group.size() == 1:
        return [part]
    parts = [None] * group.size()
    dist.all_gather_object(parts, part, group=group)
    return parts
