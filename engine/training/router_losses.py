"""Per-step scaling of megatron's MoE router losses, and the MoE metrics of a step. What is
tested and measured (padding, layouts, dummies, depths): docs/moe.md, "Router losses".

- Padding: each MoE micro-batch's routers get its padding mask (engine.training.schedule.
  moe_padding_mask), so megatron-core leaves padding out of the z-loss, the aux-loss scores and
  counts (aux_loss, seq_aux_loss, global_aux_loss) and the expert-bias counts; `_count` leaves
  it out of the moe/* loads. Not masked by megatron: token dropping (moe.capacity_factor) and
  seq_aux_loss's normalisation of a padded [b, s] micro-batch (by the rows' mean real length).
- Scaling: megatron (calculate_per_token_loss=True) attaches each micro-batch's losses times
  its real token count n_mb and expects the gradients divided by the step's token count; this
  engine never divides (engine.training.loss), so `RouterLosses.before_step` sets each
  coefficient to coeff / N, N the step's real tokens over its micro-batches and the DP x CP
  group (`run_tokens`: a prefix-shared micro-batch's tree tokens), corrected for how the
  installed megatron-core scales the TP x CP slices of a micro-batch (`coefficients`,
  `_attaches_times_tp_cp`). A step's router-loss gradient is then coeff x sum_mb n_mb
  grad(L_mb) / N, the one-process gradient at every TP x CP layout.
- Dummy micro-batches (engine.training.micro_batches `dummy`) get an all-True padding mask and
  contribute no loss, gradient, token or moe/* count; their router call has the per-micro-batch
  aux losses off (megatron's value would be 0/0).
- Megatron's process-wide router-loss tracker is sized by the first model that records:
  `before_step` drops entries sized for another model (`_reset_tracker`), so one process may
  train MoE models of different depths in turn.

Metrics (`metrics()`, after the step; the same on every rank; docs/metrics.md): moe/aux_loss
(megatron's tracked value without the coefficient, TP x CP shares summed, averaged over the
step's real micro-batches of every DP rank and over MoE layers), moe/z_loss (the mean over the
step's real tokens, averaged over layers), moe/expert_load_max_over_mean (per layer, the
busiest expert's routed positions over the mean; averaged over layers) and, with
moe.capacity_factor, moe/dropped_token_fraction. Decoder layers only: an MTP layer's router is
not counted.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from packaging.version import Version
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

try:   # megatron-core 0.17 on: the router-loss records live in a MoEMetricsTracker (the
    # moe_utils functions below are its deprecated wrappers there, the dict a copy)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
except ImportError:   # 0.16: in the module-level dict get_moe_layer_wise_logging_tracker returns
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    get_moe_metrics_tracker = None

from models.build.megatron_patches import megatron_version
from parallel.wrappers import unwrap

_TRACKED = {"load_balancing_loss": "moe/aux_loss", "seq_load_balancing_loss": "moe/aux_loss",
            "global_load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}


def _sum(vec: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(vec, group=group)
    return vec


def _all_padding(mask: torch.Tensor) -> bool:
    """Whether the micro-batch a router runs is all padding (a dummy): this rank's slice of its
    padding mask all True on every rank of the TP x CP group that shares the sequence (one
    device read and a MIN all-reduce over that group). A real micro-batch's slice can be all
    padding on one TP/CP rank only (sequence-parallel or CP shards); its peers must decide
    alike, since megatron's aux losses reduce their token counts over that group."""
    flag = mask.all().to(torch.int32).reshape(1)
    group = ps.get_tensor_and_context_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@functools.cache
def _attaches_times_tp_cp() -> bool:
    """Whether this megatron-core attaches its router losses times the TP x CP group's size
    (0.19 on; module docstring). Read once per process: `coefficients` runs every step."""
    return Version(megatron_version()).release[:2] >= (0, 19)


def _tracker() -> dict:
    """megatron's live router-loss records by name (deleting a key drops the record); each
    entry holds its per-layer vector in `_values(entry)`."""
    if get_moe_metrics_tracker is None:   # megatron-core 0.16
        return get_moe_layer_wise_logging_tracker()
    return get_moe_metrics_tracker().metrics


def _values(entry) -> torch.Tensor:
    """The per-layer vector of one record (layer n at index n - 1), live."""
    return entry["values"] if isinstance(entry, dict) else entry.values


def _reset_tracker(num_layers: int) -> None:
    """Zero megatron's router-loss records, as its own clear does, and drop those whose vector
    is not `num_layers` long (another model's): the next record recreates them at this
    model's size."""
    live = _tracker()
    for name, entry in list(live.items()):
        if len(_values(entry)) != num_layers:
            del live[name]
        else:
            _values(entry).zero_()


def coefficients(aux: float, z: float | None, tokens: float,
                 tp_cp: int) -> tuple[float, float]:
    """The (aux, z) coefficients to hand megatron for a step of `tokens` real tokens (summed
    over micro-batches and DP x CP) on a TP x CP group of `tp_cp` ranks, such that the
    router-loss gradients are coeff x the token-weighted mean of the per-micro-batch losses,
    as in one process (module docstring): megatron 0.16-0.18 divides the z-loss by tp_cp
    without attaching the difference back; 0.19 attaches both losses times tp_cp. A z of None
    (no z-loss) counts as 0."""
    z = z or 0.0
    if _attaches_times_tp_cp():
        return aux / (tokens * tp_cp), z / tokens
    return aux / tokens, z * tp_cp / tokens


def run_tokens(mb) -> int:
    """The real token positions (padding left out) the model runs for micro-batch `mb` (this
    rank's CP shard): the prefix tree's when it runs as one (engine.training.tree_batch), else
    its rows'. The count megatron's masked router losses attach per micro-batch."""
    tree = getattr(mb, "tree", None)
    padding = tree.padding if tree is not None else mb.seq_ids < 0
    return int(padding.numel() - padding.sum())


class RouterLosses:
    """Router-loss scaling and MoE metrics of one engine's chunks (inactive for dense models:
    every method is then a no-op returning nothing)."""

    def __init__(self, chunks: list):
        self.config = unwrap(chunks[0]).config
        self.active = bool(self.config.num_moe_experts)
        self.aux_coeff = self.config.moe_aux_loss_coeff
        self.z_coeff = self.config.moe_z_loss_coeff
        self.routers = [m for c in chunks for m in unwrap(c).modules()
                        if isinstance(m, TopKRouter)]
        # layer -> [routed token positions per expert..., top-k assignments before dropping]
        self.loads: dict[int, torch.Tensor] = {}
        self.capacity = self.config.moe_expert_capacity_factor is not None
        self.micro_batches = 0
        # layer -> [sum over router calls of (real tokens x megatron's z-loss mean), real tokens]
        self.z_sums: dict[int, torch.Tensor] = {}
        self._z_before = None      # the layer's tracked z-loss before this router call
        self._saved_coeff = None   # the aux coefficient while a dummy's router runs
        self._dummies = False      # whether this rank's step has a dummy micro-batch
        for router in self.routers:
            router.register_forward_pre_hook(self._enter, with_kwargs=True)
            router.register_forward_hook(self._count, with_kwargs=True)

    def _enter(self, router, args, kwargs) -> None:
        """Before a router's training forward: a dummy micro-batch's (all-True padding mask)
        runs without the per-micro-batch aux losses (module docstring); `_count` restores."""
        mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        if self.z_coeff and torch.is_grad_enabled():
            entry = _tracker().get("z_loss")
            self._z_before = (None if entry is None or router.layer_number > len(_values(entry))
                              else _values(entry)[router.layer_number - 1].clone())
        if not self._dummies or mask is None or not torch.is_grad_enabled():
            return
        if not _all_padding(mask):   # only in a step with a dummy
            return
        coeff, kinds = self.config.moe_aux_loss_coeff, router.routing_type
        self._saved_coeff = coeff
        if isinstance(kinds, list):   # one coefficient per type: keep the global one's
            self.config.moe_aux_loss_coeff = [c if k == "global_aux_loss" else 0.0
                                              for k, c in zip(kinds, coeff)]
        elif kinds != "global_aux_loss":
            self.config.moe_aux_loss_coeff = 0.0

    def _count(self, router, inputs, kwargs, outputs) -> None:
        if self._saved_coeff is not None:   # a dummy micro-batch: restore, count nothing
            self.config.moe_aux_loss_coeff, self._saved_coeff = self._saved_coeff, None
            return
        if torch.is_grad_enabled():  # training forwards (forward-only passes run no_grad)
            routing_map = outputs[1].detach()
            mask = kwargs.get("padding_mask", inputs[1] if len(inputs) > 1 else None)
            if mask is not None:   # padding routes too, but is not counted
                routing_map = routing_map & ~mask.reshape(-1, 1)
            counts = routing_map.sum(dim=0).to(torch.float64)   # stays on the device: no sync
            real = (routing_map.shape[0] if mask is None else (~mask).sum()) * router.topk
            load = torch.cat([counts, torch.as_tensor(real, dtype=torch.float64,
                                                      device=counts.device).reshape(1)])
            layer = router.layer_number
            if layer > self.config.num_layers:  # an MTP layer's router: not a decoder layer
                return
            self.loads[layer] = self.loads.get(layer, 0) + load
            if self.z_coeff:   # megatron added this call's z-loss mean over its real tokens
                after = _values(_tracker()["z_loss"])[layer - 1]
                mean = (after - (0 if self._z_before is None else self._z_before)).double()
                n = load[-1] / router.topk
                self.z_sums[layer] = self.z_sums.get(layer, 0) + torch.stack([mean * n, n])

    def before_step(self, micro_batches: list) -> None:
        """Set this step's coefficients (collective over DP x CP) and clear the trackers."""
        if not self.active:
            return
        real = [mb for mb in micro_batches if not mb.dummy]
        local = sum(run_tokens(mb) for mb in real)
        n = _sum(torch.tensor([float(local)], dtype=torch.float64),
                 ps.get_data_parallel_group(with_context_parallel=True))
        aux, z = coefficients(self.aux_coeff, self.z_coeff, max(float(n), 1.0),
                              ps.get_tensor_and_context_parallel_world_size())
        if isinstance(self.aux_coeff, (int, float)) and self.aux_coeff > 0:
            self.config.moe_aux_loss_coeff = aux
        if self.z_coeff:
            self.config.moe_z_loss_coeff = z
        for router in self.routers:
            router.reset_global_aux_loss_tracker()
        _reset_tracker(self.config.num_layers + (self.config.mtp_num_layers or 0))
        self.loads.clear()
        self.z_sums.clear()
        self.micro_batches = len(real)
        self._dummies = len(real) < len(micro_batches)

    def metrics(self) -> dict[str, float]:
        """The step's MoE metrics (collective over the world); {} for dense models."""
        if not self.active:
            return {}
        layers = self.config.num_layers
        # rows: aux, z, load ratio (then dropped share); columns: layers. The aux row: each
        # TP x CP rank's tracked share of a micro-batch's loss (its slice's scores), summed over
        # DP x CP and TP, over the micro-batches counted once per DP rank. The z row: the
        # real-token-weighted mean of megatron's per-call means (every slice, micro-batch, rank).
        vec = torch.zeros(3, layers, dtype=torch.float64)
        for name, entry in _tracker().items():
            if _TRACKED.get(name) == "moe/aux_loss":
                vec[0] += _values(entry).detach().to(torch.float64).cpu()[:layers]
        z = torch.zeros(2, layers, dtype=torch.float64)
        seen = sorted(self.z_sums)
        if seen:
            z[:, [n - 1 for n in seen]] = torch.stack([self.z_sums[n] for n in seen]).cpu().T
        dpcp = ps.get_data_parallel_group(with_context_parallel=True)
        tp = ps.get_tensor_model_parallel_group()
        losses = torch.cat([vec[0], z.flatten(), vec.new_full((1,), self.micro_batches)])
        losses = _sum(_sum(losses, dpcp), tp)
        shares = dist.get_world_size(tp) * ps.get_context_parallel_world_size()
        vec[0] = losses[:layers] / max(float(losses[-1]) / shares, 1.0)
        z = losses[layers:-1].view(2, layers)
        vec[1] = torch.where(z[1] > 0, z[0] / z[1].clamp(min=1.0), 0.0)
        # columns: the experts' routed counts, then the assignments before dropping
        counts = torch.zeros(layers, self.config.num_moe_experts + 1, dtype=torch.float64)
        seen = sorted(self.loads)
        if seen:   # the step's loads, read from the device once
            loads = torch.stack([self.loads[n] for n in seen]).cpu()
            for layer_number, load in zip(seen, loads):
                counts[layer_number - 1] += load
        counts = _sum(counts, dpcp)
        if self.config.sequence_parallel:  # each TP rank routed its own slice of tokens
            counts = _sum(counts, ps.get_tensor_model_parallel_group())
        counts, assigned = counts[:, :-1], counts[:, -1]
        mean = counts.mean(dim=1)
        vec[2] = torch.where(mean > 0, counts.max(dim=1).values / mean.clamp(min=1e-12), 0.0)
        dropped = torch.where(assigned > 0, 1.0 - counts.sum(dim=1) / assigned.clamp(min=1.0),
                              0.0)
        present = torch.zeros(layers, dtype=torch.float64)
        present[[n - 1 for n in self.loads]] = 1.0
        vec = _sum(torch.cat([vec, dropped[None]]), ps.get_pipeline_model_parallel_group())
        present = _sum(present, ps.get_pipeline_model_parallel_group()).clamp(max=1.0)
        n_layers = max(float(present.sum()), 1.0)
        out = {"moe/expert_load_max_over_mean": float(vec[2].sum()) / n_layers}
        if self.capacity:
            out["moe/dropped_token_fraction"] = float(vec[3].sum()) / n_layers
        if self.aux_coeff:
            out["moe/aux_loss"] = float(vec[0].sum()) / n_layers
        if self.z_coeff:
            out["moe/z_loss"] = float(vec[1].sum()) / n_layers
        return out
