"""Many users' LoRA adapters on one base model, each batch row taking its own adapter.

`MultiLoraLinear` replaces one `nn.Linear` of the Hugging Face base model. It keeps the base
linear (frozen) and a dict of adapters by name, each `A [r, in]`, `B [out, r]` with the output
`base(x) + (alpha / r) * (x A^T) B^T` on the tokens of the rows that adapter owns. Before a
forward, `MultiLora.assign(names, lengths)` sets for the whole model the adapter of each batch
row (`names[b]`; None: the base model alone) and its real length (`lengths[b]`: the tokens
before the right padding). The base linear runs once over the whole batch (the point of
batching). Each adapter's product runs on its own rows' real tokens only, gathered in row order
into one [tokens, in] matrix: its parameters receive gradient from those tokens alone, and the
product (and its backward) is the same computation whoever else shares the batch and however
far the batch is padded.

Batch invariance (bitwise). A user's numbers are bit-identical batched with others or alone
when every kernel computes a row independently of the batch around it. Measured on this
engine's CPU build (torch 2.x, MKL sgemm, AVX2): a float32 GEMM's row is bit-identical for any
number of rows M >= 8 (and at any offset), but M < 8 takes another MKL path whose rounding
differs; so the base linear runs on at least `MIN_GEMM_ROWS` (32) rows (zero rows appended, their
outputs dropped). Right padding changes no real position (causal attention; RMSNorm, softmax
and log-softmax are per row). tests/test_tinker.py asserts the bitwise equality; with other
kernels (another BLAS, GPUs' split-K GEMMs) the equality is to rounding (rel 1e-6).

Targets follow Tinker's LoraConfig: train_attn -> q/k/v/o_proj, train_mlp ->
gate/up/down_proj, train_unembed -> lm_head. A model with mixture-of-experts MLPs (any
parameter named with "expert") cannot serve train_mlp: its experts are not nn.Linear layers
(`unadapted_mlp` says so; the service refuses the key). Initialisation as peft's default: A
kaiming-uniform(a=sqrt(5)) from the adapter's seed, B zero (a new adapter leaves the base
model's outputs unchanged). Scaling alpha / r with alpha = 32 (LORA_ALPHA)."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine.generation.hf.gqa_attention import use_cpu_gqa

LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
MIN_GEMM_ROWS = 32   # the base GEMM's least rows: 8 measured (module docstring), 32 for margin


@dataclass(frozen=True)
class LoraSpec:
    """Tinker's LoraConfig as served: rank r >= 1 and which module groups carry adapters."""
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None

    def suffixes(self) -> tuple[str, ...]:
        return ((ATTN if self.train_attn else ()) + (MLP if self.train_mlp else ())
                + (UNEMBED if self.train_unembed else ()))


def initial_tensors(spec: LoraSpec, shapes: dict[str, tuple[int, int]]
                    ) -> dict[str, torch.Tensor]:
    """A new adapter's full tensors {path.A: [r, in], path.B: [out, r]} over the linears
    `shapes` ({module path: (out, in)}) that `spec` targets, as peft initialises them: A
    kaiming-uniform(a=sqrt(5)), i.e. uniform in +-1/sqrt(in), drawn from one generator seeded
    with spec.seed (0 when None) in sorted path order; B zero. Both backends (this module and
    models.lora.tenants) start a model from these, so a seed gives the same adapter on
    either, at every layout."""
    generator = torch.Generator().manual_seed(spec.seed if spec.seed is not None else 0)
    out = {}
    for path in sorted(shapes):
        if path.rsplit(".", 1)[-1] in spec.suffixes():
            rows, cols = shapes[path]
            bound = 1.0 / math.sqrt(cols)
            out[f"{path}.A"] = torch.empty(spec.rank, cols).uniform_(-bound, bound,
                                                                    generator=generator)
            out[f"{path}.B"] = torch.zeros(rows, spec.rank)
    return out


class RowPlan:
    """Which tokens of a batch each adapter owns (MultiLora.assign): row b takes adapter
    names[b] (None: base only) on its first lengths[b] tokens (lengths None: all of them, as
    MultiLora.per_row plans generation). `positions(seq)`: per adapter, in the order of its
    first row, the flat positions (b * seq + t) of its rows' real tokens; computed once per
    padded length and shared by every wrapped linear of the forward."""

    def __init__(self, names: list[str | None], lengths: list[int] | None):
        self.names, self.lengths = names, lengths
        self._cache: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def positions(self, seq: int, device=None) -> list[tuple[str, torch.Tensor]]:
        """(on `device`: the activations')"""
        if seq not in self._cache:
            rows: dict[str, list[int]] = {}
            for b, name in enumerate(self.names):
                if name is not None:
                    rows.setdefault(name, []).append(b)
            self._cache[seq] = [
                (name, torch.cat([torch.arange(b * seq, b * seq + (
                    seq if self.lengths is None else self.lengths[b])) for b in bs]).to(device))
                for name, bs in rows.items()]
        return self._cache[seq]


class AllRows:
    """One adapter on every token of the batch (MultiLora.every_row): `positions` gives it
    None, read by MultiLoraLinear as "all positions"."""

    def __init__(self, name: str):
        self.name = name

    def positions(self, seq: int, device=None) -> list[tuple[str, None]]:
        return [(self.name, None)]


class MultiLoraLinear(nn.Module):
    """A frozen base linear plus per-row adapters (module docstring)."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self.plan: RowPlan | AllRows | None = None   # MultiLora.assign / every_row

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter `name` with (copies of) A [r, in] and B [out, r]."""
        w = self.base.weight
        self.adapters[name] = nn.ParameterDict({
            "A": nn.Parameter(a.to(w.device, w.dtype, copy=True)),
            "B": nn.Parameter(b.to(w.device, w.dtype, copy=True))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] < MIN_GEMM_ROWS:
            pad = flat.new_zeros(MIN_GEMM_ROWS - flat.shape[0], flat.shape[-1])
            out = self.base(torch.cat([flat, pad]))[:flat.shape[0]]
        else:
            out = self.base(flat)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        groups = [(name, positions) for name, positions in
                  (self.plan.positions(x.shape[1], x.device) if self.plan is not None else [])
                  if name in self.adapters]
        if not groups:
            return out
        if groups[0][1] is None:   # AllRows: every position
            pair = self.adapters[groups[0][0]]
            scale = LORA_ALPHA / pair["A"].shape[0]
            return out + scale * ((x @ pair["A"].t()) @ pair["B"].t())
        # each adapter's rows' real tokens, as positions of the flattened [batch * seq] tokens
        # (RowPlan): one index_select gathers them and one index_add puts every product back
        # (each position at most once: out + delta, the same sum alone or batched). Per-row
        # slice assignments cost a full-size zero gradient per row and linear in backward
        # (quadratic in the batch: 1.5x slower batched than alone at 16 rows, tools/bench
        # tinker).
        flat_x = x.reshape(-1, x.shape[-1])
        index, deltas = [], []
        for name, positions in groups:
            pair = self.adapters[name]
            scale = LORA_ALPHA / pair["A"].shape[0]
            tokens = flat_x.index_select(0, positions)
            deltas.append(scale * ((tokens @ pair["A"].t()) @ pair["B"].t()))
            index.append(positions)
        flat_out = out.reshape(-1, out.shape[-1]).index_add(0, torch.cat(index),
                                                            torch.cat(deltas))
        return flat_out.reshape(out.shape)


class MultiLora:
    """The base model with every target linear wrapped (module docstring). The base weights
    are frozen; adapters are added, copied (sampler snapshots), exported and removed by
    name."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.vocab = model.config.vocab_size
        self.max_context = getattr(model.config, "max_position_embeddings", 2048)
        self.arch = type(model).__name__
        for p in model.parameters():
            p.requires_grad_(False)
        self.linears: dict[str, MultiLoraLinear] = {}
        targets = ATTN + MLP + UNEMBED
        for path, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in targets:
                parent_path, _, child = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                wrapped = MultiLoraLinear(module)
                setattr(parent, child, wrapped)
                self.linears[path] = wrapped
        self.specs: dict[str, LoraSpec] = {}
        experts = [n for n, _ in model.named_parameters() if "expert" in n]
        # why train_mlp cannot be served (None: it can): transformers' experts are not
        # nn.Linear layers (fused 3D parameters), so no adapter would reach them
        self.unadapted_mlp = None if not experts else (
            f"{self.arch} has mixture-of-experts MLPs ({experts[0]}, ...), whose experts this "
            "backend's adapters do not reach")

    @classmethod
    def from_folder(cls, model_dir: str) -> "MultiLora":
        """The HF folder's model in float32, in eval mode, on the current GPU where there is
        one (else the CPU, grouped KV heads read in place: engine.generation.hf.gqa_attention),
        wrapped."""
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        use_cpu_gqa(model.to("cuda" if torch.cuda.is_available() else "cpu").eval())
        return cls(model)

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """{module path: (out, in)} of every wrapped linear."""
        return {path: (linear.base.out_features, linear.base.in_features)
                for path, linear in self.linears.items()}

    def add(self, name: str, spec: LoraSpec) -> None:
        self.load(name, spec, initial_tensors(spec, self.shapes))

    def remove(self, name: str) -> None:
        for linear in self.linears.values():
            if name in linear.adapters:
                del linear.adapters[name]
        self.specs.pop(name, None)

    def _pairs(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """(key path.A / path.B, parameter) of adapter `name`: sorted module path, A then B."""
        return [(f"{path}.{k}", linear.adapters[name][k])
                for path, linear in sorted(self.linears.items())
                if name in linear.adapters for k in ("A", "B")]

    def parameters(self, name: str) -> list[nn.Parameter]:
        """The adapter's parameters in a fixed order (sorted module path, A then B)."""
        return [p for _, p in self._pairs(name)]

    def full(self, name: str, tensors: list[torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
        """{path.A / path.B: tensor} of adapter `name` (copies), or of `tensors` (one per
        `parameters(name)`, e.g. AdamW's moments), keyed the same way."""
        pairs = self._pairs(name)
        values = [p for _, p in pairs] if tensors is None else tensors
        return {key: t.detach().clone() for (key, _), t in zip(pairs, values)}

    def shards(self, name: str, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of `full` in `parameters(name)`'s order (one process holds them
        whole; models.lora.tenants holds TP shards)."""
        return [full[key].clone() for key, _ in self._pairs(name)]

    def logits(self, ids: torch.Tensor, names: list[str | None], lengths: list[int]
               ) -> torch.Tensor:
        """float32 logits [b, s, vocab] of right-padded `ids` [b, s], row b with adapter
        names[b] on its first lengths[b] tokens."""
        self.assign(names, lengths)
        try:
            return self.model(input_ids=ids.to(self.model.device),
                              use_cache=False).logits.float()
        finally:
            self.assign(None)

    every_replica = False   # one process (engine.tinker.compute.run_losses)

    @staticmethod
    def micro_batches(rows: int) -> list[tuple[int, int]]:
        """The batch's rows in one piece (engine.tinker.compute.run_losses)."""
        return [(0, rows)] if rows else []

    @staticmethod
    def backward(loss: torch.Tensor | None) -> None:
        """The backward of the last `logits` call from `loss`, where it has gradients."""
        if loss is not None and loss.requires_grad:
            loss.backward()

    def load(self, name: str, spec: LoraSpec, state: dict[str, torch.Tensor]) -> None:
        """Add adapter `name` with exactly the tensors of `state` (as `state` wrote them)."""
        for path in sorted(self.linears):
            if path.rsplit(".", 1)[-1] in spec.suffixes():
                self.linears[path].add(name, state[f"{path}.A"], state[f"{path}.B"])
        self.specs[name] = spec

    @contextlib.contextmanager
    def every_row(self, adapter: str | None):
        """Within the block every forward runs adapter `adapter` (None: the base model alone)
        on every position of every row, whatever the batch's shape: how a generation engine
        samples one user's adapter (engine.tinker.sampler), padding and prefill batches
        included (a pad's product is computed and never read)."""
        self._plan(AllRows(adapter) if adapter is not None else None)
        try:
            yield
        finally:
            self._plan(None)

    @contextlib.contextmanager
    def per_row(self, names: list[str | None]):
        """Within the block every forward runs row b with adapter names[b] (None: the base
        model) on all its positions: how a generation engine samples several users' adapters
        in one batch (engine.tinker.sampler; the batch's rows stay in place through decoding,
        and pads' products are computed and never read)."""
        self._plan(RowPlan(names, None))
        try:
            yield
        finally:
            self._plan(None)

    def assign(self, names: list[str | None] | None, lengths: list[int] | None = None) -> None:
        """Row b of the next forward takes adapter names[b] on its first lengths[b] tokens
        (None: every row is base only)."""
        if names is not None and (lengths is None or len(lengths) != len(names)):
            raise ValueError("assign: one length per row")
        self._plan(RowPlan(names, lengths) if names is not None else None)

    def _plan(self, plan: RowPlan | AllRows | None) -> None:
        """Every wrapped linear's plan for the next forwards."""
        for linear in self.linears.values():
            linear.plan = plan
