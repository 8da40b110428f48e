"""Several users' LoRA adapters on one Megatron GPTModel, each batch row taking its own: the
Tinker service's Megatron backend (engine.tinker.mcore; docs/tinker.md).

`TenantLora(chunk)` freezes the model and puts a `TenantSite` beside every linear a dense
decoder layer adapts (q/k/v_proj in linear_qkv, o_proj in linear_proj, gate/up_proj in
linear_fc1, down_proj in linear_fc2: models.lora.sites) and beside the output layer (lm_head,
column-parallel over the padded vocabulary). A site holds one models.lora.adapters.LoraAdapter
per user (the engine's own LoRA: TP shards, TP reductions, sequence parallelism) and one
forward hook that adds, for each user u of the batch, adapter_u(x[:, rows_u]) to
output[:, rows_u]. Rows are megatron's batch dimension (dim 1 of [s, b, h]), which neither
TP nor sequence parallelism splits. `assign(names)` sets row b's user for the next forward;
every TP rank of a replica must assign the same rows, because the adapters' TP collectives
run per user in assignment order.

Adapters are created from and exported to full HF-shaped tensors keyed `{path}.A` [r, in]
and `{path}.B` [out, r]. The paths are transformers' module paths
(model.layers.{i}.self_attn.q_proj, ..., lm_head), so a state is the same at every layout and
in the service's transformers backend (engine.tinker.lora). `full` / `shards` convert any
per-parameter tensors (AdamW's moments) the same way.

On a pipeline stage the sites are that stage's layers' (their HF paths keep the global layer
numbers) and, on the last, lm_head's. A MoE layer's MLP takes no adapter (`moe` says a model
has one): its experts see the tokens permuted by the router's dispatch, where the row -> user
map does not reach; its attention does. Other linears than these are refused
(`TenantUnsupportedError` names them)."""
from __future__ import annotations

import torch
from torch import nn

from models.lora.adapters import LoraAdapter
from models.lora.sites import LAYERS, decoder_layer_sites, new_adapter
from models.lora.slices import LoraSpec, Slice
from models.lora.targets import ATTENTION, MLP
from parallel.wrappers import unwrap

TENANT_SUFFIX = "_tenants"   # the users' adapters of linear `linear_qkv`: `linear_qkv_tenants`
UNEMBED = "lm_head"
DENSE_SITES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class TenantUnsupportedError(ValueError):
    """The model cannot carry per-user adapters (message names what it has)."""


class _OutputLinear:
    """The output layer as LoraAdapter reads a linear (weight, tp_group, sequence_parallel):
    with tied embeddings megatron's output_layer holds no weight and computes with the
    embedding's."""

    def __init__(self, model):
        out = model.output_layer
        self.weight = model.shared_embedding_or_output_weight() if out.weight is None \
            else out.weight
        self.tp_group, self.sequence_parallel = out.tp_group, out.sequence_parallel


class TenantSite(nn.Module):
    """The users' adapters of one linear (module docstring) and the hook that routes rows."""

    def __init__(self, module: nn.Module, make, fused: list[Slice], paths: dict[str, str],
                 out_features: dict[str, int]):
        """`module`: the megatron linear hooked; `make(targeted, spec)`: a zero LoraAdapter
        of it; `paths`: {slice: HF module path}; `out_features`: {slice: HF rows} (lm_head:
        the vocabulary, where megatron's slice is padded)."""
        super().__init__()
        self.make, self.fused, self.paths, self.out_features = make, fused, paths, out_features
        self.adapters = nn.ModuleDict()
        self.rows: list[tuple[str, torch.Tensor | None]] = []   # TenantLora.assign
        module.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        out, bias = output
        x = args[0]
        for name, rows in self.rows:
            if name not in self.adapters:
                continue
            if rows is None:   # one user owns the whole batch: no gather, no scatter
                out = out + self.adapters[name](x).to(out.dtype)
            else:
                delta = self.adapters[name](x.index_select(1, rows))
                out = out.index_add(1, rows, delta.to(out.dtype))
        return out, bias

    def add(self, name: str, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        targeted = frozenset(sl.name for sl in self.fused) & spec.targets
        if not targeted:
            return
        adapter = self.make(targeted, spec)
        for sl in adapter.slices:
            a, b = tensors[f"{self.paths[sl.name]}.A"], tensors[f"{self.paths[sl.name]}.B"]
            adapter.set_full(sl.name, a, _pad_rows(b, sl.out_features))
        adapter.requires_grad_(True)
        self.adapters[name] = adapter

    def export(self, name: str, tensors: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """{key: full HF tensor} of user `name`'s matrices here, or of `tensors` (one per
        adapter parameter, in its order) laid out like them. Collective over the TP group."""
        adapter = self.adapters[name]
        with _as_matrices(adapter, tensors):
            out = {}
            for sl in adapter.slices:
                a, b = adapter.full_matrices(sl.name)
                path = self.paths[sl.name]
                out[f"{path}.A"], out[f"{path}.B"] = a, b[:self.out_features[sl.name]]
        return out

    def shards(self, name: str, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shards of the full HF tensors `full`, one per adapter parameter."""
        adapter = self.adapters[name]
        local = [torch.zeros_like(p) for p in adapter.parameters()]
        with _as_matrices(adapter, local):
            for sl in adapter.slices:
                path = self.paths[sl.name]
                adapter.set_full(sl.name, full[f"{path}.A"],
                                 _pad_rows(full[f"{path}.B"], sl.out_features))
        return local


class _as_matrices:
    """Inside: `adapter` reads and writes `tensors` (one per parameter, in order) as its
    matrices (its frozen-reference mode, models.lora.modes); None: its parameters."""

    def __init__(self, adapter: LoraAdapter, tensors: list[torch.Tensor] | None):
        self.adapter, self.tensors = adapter, tensors

    def __enter__(self):
        if self.tensors is not None:
            names = [n for n, _ in self.adapter.named_parameters()]
            self.saved = (self.adapter.reference, self.adapter.use_reference)
            self.adapter.reference = dict(zip(names, self.tensors))
            self.adapter.use_reference = True

    def __exit__(self, *exc):
        if self.tensors is not None:
            self.adapter.reference, self.adapter.use_reference = self.saved


def _pad_rows(b: torch.Tensor, rows: int) -> torch.Tensor:
    """B [out, r] with zero rows appended up to `rows` (the padded vocabulary)."""
    return b if b.shape[0] == rows else torch.cat([b, b.new_zeros(rows - b.shape[0],
                                                                  b.shape[1])])


class TenantLora:
    """Per-user adapters on one GPTModel chunk (module docstring)."""

    def __init__(self, chunk, vocab_size: int):
        model = unwrap(chunk)
        model.requires_grad_(False)
        self.sites: list[TenantSite] = []
        self.shapes: dict[str, tuple[int, int]] = {}   # {HF path: (out, in)}
        every = LoraSpec(rank=1, alpha=1.0, targets=frozenset(ATTENTION + MLP))
        attention = LoraSpec(rank=1, alpha=1.0, targets=frozenset(ATTENTION))
        self.moe = False   # a layer has MoE experts: its MLP takes no adapter
        for layer in model.decoder.layers:
            moe = getattr(getattr(layer, "mlp", None), "experts", None) is not None
            self.moe |= moe
            for parent, name, kind, fused, _, _, _, keys in decoder_layer_sites(
                    layer, attention if moe else every, {}, LAYERS, {}):
                if name not in DENSE_SITES:
                    raise TenantUnsupportedError(
                        f"the Megatron backend adapts {', '.join(DENSE_SITES)}; this model "
                        f"has {parent.__class__.__name__}.{name}")
                config = layer.config

                def make(targeted, spec, parent=parent, name=name, kind=kind, fused=fused,
                         config=config, keys=keys):
                    return new_adapter(parent, name, kind, fused, targeted, spec, config, keys)
                self._site(parent, name, make, fused, keys,
                           {sl.name: sl.out_features for sl in fused})
        if model.post_process:
            self._unembed(model, vocab_size)

    def _unembed(self, model, vocab_size: int) -> None:
        """The output layer's site (the last pipeline stage's)."""
        linear = _OutputLinear(model)
        tp = linear.tp_group.size()
        fused = [Slice(UNEMBED, linear.weight.shape[1], linear.weight.shape[0] * tp)]

        def make_unembed(targeted, spec):
            return LoraAdapter(linear, "column", fused, targeted, spec)
        self._site(model, "output_layer", make_unembed, fused, {UNEMBED: UNEMBED},
                   {UNEMBED: vocab_size})

    def _site(self, parent, name, make, fused, paths, out_features) -> None:
        site = TenantSite(getattr(parent, name), make, fused, paths, out_features)
        parent.add_module(name + TENANT_SUFFIX, site)
        self.sites.append(site)
        for sl in fused:
            self.shapes[paths[sl.name]] = (out_features[sl.name], sl.in_features)

    def add(self, name: str, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Adapter `name` of `spec` (its targets: HF projection names and lm_head) with the
        full tensors `tensors` ({path}.A / .B of every targeted path)."""
        for site in self.sites:
            site.add(name, spec, tensors)

    def remove(self, name: str) -> None:
        for site in self.sites:
            if name in site.adapters:
                del site.adapters[name]

    def parameters(self, name: str) -> list[nn.Parameter]:
        """This rank's parameters of adapter `name`, in a fixed order (sites, then each
        adapter's own order)."""
        return [p for site in self.sites if name in site.adapters
                for p in site.adapters[name].parameters()]

    def full(self, name: str, tensors: list[torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
        """{path.A / path.B: full HF tensor} of adapter `name`, or of `tensors` (aligned with
        `parameters(name)`, e.g. AdamW's moments). Collective over the TP group."""
        out, k = {}, 0
        for site in self.sites:
            if name in site.adapters:
                n = len(list(site.adapters[name].parameters()))
                out.update(site.export(name, None if tensors is None else tensors[k:k + n]))
                k += n
        return out

    def shards(self, name: str, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shards of full HF tensors, aligned with `parameters(name)`."""
        return [t for site in self.sites if name in site.adapters
                for t in site.shards(name, full)]

    def assign(self, names: list[str | None] | None, device=None) -> None:
        """Row b of the next forward takes adapter names[b] (None: the base alone); the row
        indices on `device` (the activations'), or None where one adapter has every row."""
        rows: dict[str, list[int]] = {}
        for b, name in enumerate(names or []):
            if name is not None:
                rows.setdefault(name, []).append(b)
        everyone = len(rows) == 1 and len(next(iter(rows.values()))) == len(names)
        plan = [(name, None if everyone else torch.tensor(bs, dtype=torch.long, device=device))
                for name, bs in rows.items()]
        for site in self.sites:
            site.rows = plan
