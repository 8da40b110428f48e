"""LoRA adapters on Megatron's tensor-parallel linears (docs/lora.md).

One `LoraAdapter` sits beside one Megatron linear (as the sibling module `<linear>_lora`, so
the base weight keeps its name) and adds `scaling * B(A(x))` to the linear's output through a
forward hook. A fused Megatron linear carries one (A, B) pair per HF projection ("slice",
models.lora.slices.Slice, with the map of its output rows onto megatron's): linear_qkv the
slices q_proj/k_proj/v_proj (outputs interleaved per query group, as
models.layers.transforms.merge_qkv), linear_fc1 gate_proj/up_proj (outputs [gate; up] per TP
rank, as merge_gate_up), the Gated DeltaNet's in_proj in_proj_qkv/z/b/a, an expert's
linear_fc1 the one slice gate_up_proj. Shapes, with r the rank and tp the size of the linear's
TP group:

- column-parallel (linear_qkv, linear_fc1): A_s [r, in] replicated, B_s [out_s / tp, r] split
  on the output like the base weight. h_s = A_s x [s, b, r] is the same on every TP rank; its
  gradient (each rank sees only its B shard) is all-reduced over the TP group
  (`copy_to_tensor_model_parallel_region` on h_s), so A's gradient is complete on every rank.
  With sequence parallelism x is this rank's sequence shard [s / tp, b, in] and the rank-r
  products are gathered instead of x: the slices' A_s x_shard, concatenated [s / tp, b, R]
  (R the sum of their ranks), all-gathered over the sequence in one call
  (`gather_from_sequence_parallel_region`, [s, b, R] out; backward: the reduce-scatter of its
  gradient, which sums the B shards' parts and keeps this rank's rows). A's gradient is then
  this shard's part only: A is tagged `sequence_parallel`, so megatron's finalize_model_grads
  sums it over the TP group once per step, as it does the norms' (docs/lora.md).
- row-parallel (linear_proj, linear_fc2): A [r, in / tp] split on the input like the base
  weight, B [out, r] replicated. The partial h = A x_shard is all-reduced over the TP group
  (`reduce_from_tensor_model_parallel_region`: the TP reduction of the adapter path); with
  sequence parallelism it is reduce-scattered along the sequence instead
  (`reduce_scatter_to_sequence_parallel_region`, [s, b, r] in, [s / tp, b, r] out; backward:
  all-gather of the rank-r gradient), and B maps this rank's rows to the output's sequence
  shard: B is tagged `sequence_parallel` and its gradient summed over TP like A's above.
- MoE experts with explicit expert communication (ep > 1 or expert TP > 1): the linear itself
  communicates nothing (the token dispatcher gathers inputs and reduce-scatters outputs over the
  expert-TP group); the adapter does the same on activations, and the replicated matrix
  (column: A, row: B) passes through `copy_to_tensor_model_parallel_region` over the expert-TP
  group so its gradient is summed there. The grouped experts compute the same through
  `factors` instead of the hook.
- replicated (MLA's down projections, MoE routers, Qwen3.5-MoE's shared expert gate): A and B
  whole, see LoraAdapter; a router's adapter adds to its logits (`wrap_gating`).

`reduce=False` drops the adapter's TP reductions of activations (under sequence parallelism
the gather's backward keeps this rank's rows unsummed, the reduce-scatter becomes a split): a
deliberately wrong adapter for negative controls only. The modes of models.lora.modes:
`enabled=False` (adapters_disabled) leaves the linear's output as the base computes it (the
reference of a run from fresh adapters: the policy's own frozen base); `use_reference=True`
(reference_adapters) computes with the adapter's frozen `reference` matrices instead of its
parameters (the reference of a run from model.lora.init_from: that starting adapter, put there
by models.lora.peft.load_reference_adapter), a second copy of the rank-r matrices with the
parameters' shapes and shards (TP, experts over EP, this pipeline stage's layers), outside the
state dict (never checkpointed, no gradient); `dropout_off=True` (dropout_disabled, every
forward-only pass: TrainEngine.forward_only) applies no dropout. Dropout (model.lora.dropout >
0) otherwise acts on the adapter's input in training mode with the ambient RNG; training
results then depend on the layout (documented in docs/lora.md). On a TP shard of the input (a
column adapter's sequence shard, a row adapter's features) it draws the mask of the whole input
and keeps this rank's part.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from models.lora.fused import fuse
from models.lora.slices import LoraSpec, Slice

ADAPTER_SUFFIX = "_lora"   # the adapter of megatron linear `linear_qkv` is `linear_qkv_lora`


class LoraAdapter(torch.nn.Module):
    """The adapter of one Megatron linear (module docstring). Parameters `A_<slice>`,
    `B_<slice>` hold this rank's shards; `kind` is "column", "row" or "replicated" (a linear
    every TP rank holds whole, MLA's down projections: A and B whole, no communication; under
    sequence parallelism the input is this rank's sequence shard, and A and B carry the
    linear's `sequence_parallel` tag, so megatron sums their gradients over TP as it does the
    base weight's)."""

    def __init__(self, linear, kind: str, fused: list[Slice], targeted, spec: LoraSpec,
                 qkv_layout: tuple[int, int, int] | None = None, keys: dict | None = None):
        """`fused`: every HF projection of the linear, in its output order; `targeted`: the
        names that get an (A, B) pair (the others contribute zeros); `keys`: {slice: its peft
        key}, which gives each slice its rank and scaling (LoraSpec.rank_of / scaling_of;
        absent: spec.rank and spec.scaling)."""
        super().__init__()
        self.kind, self.spec = kind, spec
        self.fused = list(fused)
        self.slices = [sl for sl in fused if sl.name in targeted]
        keys = keys or {}
        self.ranks = {sl.name: spec.rank_of(keys.get(sl.name)) for sl in self.slices}
        self.scalings = {sl.name: spec.scaling_of(keys.get(sl.name)) for sl in self.slices}
        self.reduce = True
        self.enabled = True            # False inside adapters_disabled: the base alone
        # {parameter name: frozen tensor} (models.lora.modes.attach_reference), used while
        # use_reference is on (models.lora.modes.reference_adapters)
        self.reference: dict[str, torch.Tensor] | None = None
        self.use_reference = False
        self.dropout_off = False       # True inside dropout_disabled (forward-only passes)
        self.group = linear.tp_group
        self.tp_size = self.group.size() if self.group is not None else 1
        self.tp_rank = self.group.rank() if self.group is not None else 0
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False))
        if kind == "replicated":   # whole on every rank: the math of one rank, no gathers
            self.group = self.group or parallel_state.get_tensor_model_parallel_group()
            self.tp_size, self.tp_rank, self.sequence_parallel = 1, 0, False
        self.explicit = bool(getattr(linear, "explicit_expert_comm", False))
        self.is_expert = bool(getattr(linear, "is_expert", False))
        self.qkv_layout = qkv_layout   # (local query groups, heads per group, head dim)
        dtype = linear.weight.dtype
        device = linear.weight.device
        for sl in self.slices:
            a_in = sl.in_features // (self.tp_size if kind == "row" else 1)
            rank = self.ranks[sl.name]
            a = torch.nn.Parameter(torch.zeros(rank, a_in, dtype=dtype, device=device))
            if kind == "row":
                set_tensor_model_parallel_attributes(a, True, 1, 1)
            self.register_parameter(f"A_{sl.name}", a)
            for name, rows in zip(self._b_names(sl), sl.blocks()):
                b = torch.nn.Parameter(torch.zeros(
                    rows // (self.tp_size if kind == "column" else 1), rank, dtype=dtype,
                    device=device))
                if kind == "column":
                    set_tensor_model_parallel_attributes(b, True, 0, 1)
                self.register_parameter(name, b)
        if kind == "replicated":
            tag = bool(getattr(linear.weight, "sequence_parallel", False))
            for p in self.parameters():
                p.sequence_parallel = tag
        elif self._sequence_sharded():   # the replicated matrix sees this rank's shard only
            for name, p in self.named_parameters():
                p.sequence_parallel = name.startswith("A_" if kind == "column" else "B_")

    @staticmethod
    def _b_names(sl: Slice) -> list[str]:
        """Parameter names of the slice's B blocks: B_<slice>, or B_<slice>_<i> per part."""
        if not sl.parts:
            return [f"B_{sl.name}"]
        return [f"B_{sl.name}_{i}" for i in range(len(sl.parts))]

    def _slice(self, name: str) -> Slice:
        return next(sl for sl in self.slices if sl.name == name)

    def _tensor(self, name: str) -> torch.Tensor:
        """Parameter `name` (A_<slice>, B_<slice>[_i]), or its frozen reference copy while
        `use_reference` is on (reference_adapters)."""
        if not self.use_reference:
            return getattr(self, name)
        if self.reference is None:
            raise RuntimeError("a LoRA adapter has no reference matrices "
                               "(models.lora.modes.attach_reference)")
        return self.reference[name]

    def matrices(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of slice `name` as this rank computes with them: B's rows are this rank's
        rows of the slice in the fused linear's local order (its blocks concatenated); the
        reference copies inside reference_adapters."""
        blocks = [self._tensor(n) for n in self._b_names(self._slice(name))]
        return self._tensor(f"A_{name}"), blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def set_full(self, name: str, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Copy full (unsharded, HF-ordered) A [r, in] and B [out, r] of slice `name`; keeps
        this rank's shard (Slice: row order and per-block TP split). Into the reference copies
        inside reference_adapters."""
        sl = self._slice(name)
        a = self._tensor(f"A_{name}")
        if self.kind == "row":
            a_full = a_full.chunk(self.tp_size, dim=1)[self.tp_rank]
            blocks = [b_full]
        else:
            if b_full.shape[0] != sl.out_features:
                raise ValueError(f"LoRA {name}: got B {tuple(b_full.shape)}, the projection "
                                 f"has {sl.out_features} rows")
            blocks = [blk.chunk(self.tp_size, dim=0)[self.tp_rank]
                      for blk in sl.to_blocks(b_full)]
        params = [self._tensor(n) for n in self._b_names(sl)]
        shapes = [tuple(a_full.shape)] + [tuple(x.shape) for x in blocks]
        needed = [tuple(a.shape)] + [tuple(p.shape) for p in params]
        if shapes != needed:
            raise ValueError(f"LoRA {name}: got A, B {shapes}, this shard needs {needed}")
        with torch.no_grad():
            a.copy_(a_full.to(a.dtype))
            for p, blk in zip(params, blocks):
                p.copy_(blk.to(p.dtype))

    def full_matrices(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Full HF-ordered (A [r, in], B [out, r]) of slice `name`, the inverse of `set_full`.
        Collective over the linear's TP group (every TP rank calls it together)."""
        sl = self._slice(name)
        a = self._tensor(f"A_{name}").detach()
        params = [self._tensor(n).detach() for n in self._b_names(sl)]
        if self.kind == "row":
            return gather_cat(a, 1, self.group, self.tp_size), params[0]
        blocks = [gather_cat(p, 0, self.group, self.tp_size) for p in params]
        return a, sl.from_blocks(blocks).contiguous()

    def hook(self, module, args, output):
        """Forward hook of the adapted linear: (out, bias) -> (out + adapter(x), bias); the
        output untouched while the adapter is disabled (`adapters_disabled`)."""
        if not self.enabled:
            return output
        out, bias = output
        return out + self(args[0]).to(out.dtype), bias

    def wrap_gating(self, router) -> None:
        """Adapt a MoE router (a "replicated" adapter of its weight, peft's target_parameter
        gate.weight): its `gating(x)` returns the logits x W^T plus this adapter's
        scaling * x A^T B^T (nothing while disabled); the routing after it is megatron's."""
        base = router.gating

        def gating(x: torch.Tensor) -> torch.Tensor:
            logits = base(x)
            return logits + self(x).to(logits.dtype) if self.enabled else logits

        router.gating = gating

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the linear's output for its input `x` (same leading
        dimensions as the base output; communication as in the module docstring)."""
        if self.kind == "row":
            return self._row(x)
        return self._column(x)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The low-rank update of an expert linear as factors (A [r, in_local], scaling * B
        [out_local, r]) for models.layers.experts.grouped, which computes x A^T B^T for every
        local expert in its grouped matmuls instead of calling the linears (their hooks); the
        same expert-TP gradient reduction as `_column` / `_row`. None while disabled.
        The reduced factor's gradient is made contiguous first: megatron's all-reduce
        (mappings._reduce) reduces a contiguous copy and returns the input unreduced when the
        gradient is not contiguous, as the grouped experts' padded bmm gives it (w.transpose);
        without it expert-TP > 1 on that path lost the reduction (grad norm off by 1e-2)."""
        if not self.enabled:
            return None
        name = self.slices[0].name
        a, b = self.matrices(name)
        if self.explicit and self._communicates():
            if self.kind == "column":
                a = _contiguous_grad(copy_to_tensor_model_parallel_region(a, group=self.group))
            else:
                b = _contiguous_grad(copy_to_tensor_model_parallel_region(b, group=self.group))
        return a, b * self.scalings[name]

    def _dropout(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """`x` dropped out in training (module.training, outside dropout_disabled; `x` itself
        otherwise, drawing no random numbers). `dim`: `x` is this TP rank's shard along `dim`
        (a column adapter's sequence shard under sequence parallelism, a row adapter's input
        features): the mask of the whole tensor is drawn, as one process draws it, and this
        rank's part kept (a mask per shard would repeat itself on every TP rank of one
        generator state)."""
        p = self.spec.dropout
        if not (p and self.training) or self.dropout_off:
            return x
        if dim is None or self.tp_size == 1:
            return F.dropout(x, p, training=True)
        shape = list(x.shape)
        n, shape[dim] = shape[dim], shape[dim] * self.tp_size
        noise = x.new_empty(shape).bernoulli_(1 - p).div_(1 - p)
        return x * noise.narrow(dim, self.tp_rank * n, n)

    def _communicates(self) -> bool:
        return self.tp_size > 1 and self.reduce

    def _sequence_sharded(self) -> bool:
        """The adapter's activations are sequence shards (sequence parallelism, TP > 1, not an
        expert linear: those get gathered tokens from the dispatcher)."""
        return self.sequence_parallel and not self.explicit and self.tp_size > 1

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        shard = self._sequence_sharded()
        x = self._dropout(x, 0 if shard else None)
        pairs = [self.matrices(sl.name) for sl in self.slices]
        if self.explicit and self._communicates():
            pairs = [(copy_to_tensor_model_parallel_region(a, group=self.group), b)
                     for a, b in pairs]
        hs = [F.linear(x, a) for a, _ in pairs]
        if shard:   # the slices' rank-r products gathered as one, the gradient reduce-scattered
            h = gather_from_sequence_parallel_region(hs[0] if len(hs) == 1 else torch.cat(
                hs, dim=-1), tensor_parallel_output_grad=self.reduce, group=self.group)
            hs = h.split([self.ranks[sl.name] for sl in self.slices], dim=-1)
        elif not self.explicit and self._communicates():
            hs = [copy_to_tensor_model_parallel_region(h, group=self.group) for h in hs]
        return self._interleave([F.linear(h, b) * self.scalings[sl.name]
                                 for sl, h, (_, b) in zip(self.slices, hs, pairs)])

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        name = self.slices[0].name
        a, b = self.matrices(name)
        h = F.linear(self._dropout(x, -1), a)
        if self.explicit:
            if self._communicates():
                b = copy_to_tensor_model_parallel_region(b, group=self.group)
            return F.linear(h, b) * self.scalings[name]   # partial: the dispatcher sums it
        if self._sequence_sharded():   # summed and split along the sequence, rank r wide
            h = (reduce_scatter_to_sequence_parallel_region(h, group=self.group)
                 if self.reduce else scatter_to_sequence_parallel_region(h, group=self.group))
        elif self._communicates():
            h = reduce_from_tensor_model_parallel_region(h, group=self.group)
        return F.linear(h, b) * self.scalings[name]

    def _interleave(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Per-slice column outputs [..., out_s/tp] -> the fused linear's local layout."""
        return fuse(outs, [sl.name for sl in self.slices], self.fused, self.tp_size,
                    self.qkv_layout, -1)

    def delta(self) -> torch.Tensor:
        """scaling * B A (float32) of every slice in the local layout of the base weight
        [out_local, in_local], zero rows for untargeted slices (merged weight: base + delta)."""
        rows = [(b.float() @ a.float()) * self.scalings[sl.name]
                for sl, (a, b) in ((sl, self.matrices(sl.name)) for sl in self.slices)]
        return fuse(rows, [sl.name for sl in self.slices], self.fused, self.tp_size,
                    self.qkv_layout, 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Megatron distributed-checkpoint tensors: the TP-split matrix (column: B on dim 0,
        row: A on dim 1) sharded over the linear's TP group, the other one replicated; layer and
        expert offsets come from the caller (TransformerBlock, SequentialMLP)."""
        state = self.state_dict(prefix="", keep_vars=True)
        split = {"column": "B_", "row": "A_"}.get(self.kind)   # replicated: nothing split
        axis = {k: (0 if self.kind == "column" else 1) for k in state
                if split and k.startswith(split)}
        # the DP x CP group too: given only tp_group, megatron numbers every data-parallel
        # copy replica 0 and a save at DP >= 2 fails ("Invalid access pattern"); expert
        # adapters get their expert-DP replica ids from SequentialMLP afterwards
        dp_cp = (metadata or {}).get("dp_cp_group") or \
            parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets,
                                                   tp_group=self.group, dp_cp_group=dp_cp)


def _contiguous_grad(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, whose gradient reaches the op that made it contiguous."""
    if tensor.requires_grad:
        tensor.register_hook(lambda grad: grad.contiguous())
    return tensor


def gather_cat(tensor: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank of `group` (of `size` ranks)'s `tensor` concatenated along `dim` in rank
    order (a TP shard's full tensor, an EP rank's experts' all experts); collective."""
    if size == 1:
        return tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
