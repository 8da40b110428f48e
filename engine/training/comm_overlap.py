"""Overlap of the data-parallel gradient reduction and parameter gathering with compute.

`OverlapSettings` is what engine.config.parallel_settings resolves from the parallel.* keys;
`ddp_config` turns it into megatron's DistributedDataParallelConfig, `install_schedule_hooks`
wires the model config the way megatron's own training loop does (megatron-core 0.16 and 0.19
share these names):

- overlap_grad_reduce: each DDP bucket's reduce-scatter (distributed optimizer) or all-reduce
  over the DP x CP group (expert buckets: the expert-DP group) starts asynchronously from the
  backward hook of the last micro-batch as soon as every gradient in the bucket is final;
  `config.no_sync_func` (the chunks' `no_sync`) keeps earlier micro-batches from reducing and
  `config.grad_sync_func` (`start_grad_sync`) lets the pipeline schedules launch a chunk's
  reduction when its last backward ends. `finalize_model_grads` (engine.training.train_engine)
  waits for them (`finish_grad_sync`) before the grad norm is taken.
- overlap_param_gather (distributed optimizer only): after `optimizer.step` each DP rank holds
  only its own shard of the updated parameters; the all-gather of each bucket is issued by a
  forward pre-hook the next time the model runs (each pipeline stage on its own: no
  `align_param_gather`). Until then the other shards of `param.data` hold the previous
  step's values, so anything that reads parameters outside a forward pass (checkpoint save,
  the RL weight sync, HF export) first calls `finish_param_gather`; modules that read their
  children's parameters in their own forward (GroupedExperts) get a hook that gathers them.
- with virtual pipeline stages and overlap_grad_reduce on, the interleaved schedule overlaps
  its p2p sends/receives with compute (`overlap_p2p_comm`, which needs `batch_p2p_comm` off).

None of this changes a number: the reductions are the same collectives on the same buffers,
only issued earlier (tests/multirank/sft_invariance.py and rl_invariance.py run with both on).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig

from engine.training.settings import OverlapSettings  # noqa: F401 (re-exported)
from models.layers.experts.grouped import GroupedExperts


def ddp_config(settings: OverlapSettings, distributed_optimizer: bool,
               params_dtype: torch.dtype) -> DistributedDataParallelConfig:
    """megatron's DDP config of `settings` (per-token loss: never averaged in the collective,
    see engine.training.loss)."""
    if settings.overlap_param_gather and not distributed_optimizer:
        raise ValueError("overlap_param_gather needs the distributed optimizer")
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        align_param_gather=False,
        bucket_size=settings.bucket_elements(params_dtype),
        average_in_collective=False)


def p2p_overrides(settings: OverlapSettings) -> dict:
    """TransformerConfig fields of the interleaved schedule's p2p overlap (current parallel
    state): on with virtual pipeline stages and overlap_grad_reduce, else nothing."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if settings.overlap_grad_reduce and vpp and vpp > 1:
        return {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    return {}


def install_schedule_hooks(chunks: list, settings: OverlapSettings) -> None:
    """Set the model config's no_sync_func / grad_sync_func (overlap_grad_reduce) as megatron's
    training loop does: one function for one chunk, a list (one per virtual stage) otherwise;
    and the parameter-gather hooks of install_subtree_gather_hooks (overlap_param_gather)."""
    install_subtree_gather_hooks(chunks)
    if not settings.overlap_grad_reduce:
        return
    for chunk in chunks:
        config = chunk.config
        no_sync = [c.no_sync for c in chunks]
        grad_sync = [c.start_grad_sync for c in chunks]
        config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync


def install_subtree_gather_hooks(chunks: list) -> int:
    """Forward pre-hooks for modules that read their children's parameters in their own
    forward (models.layers.experts.grouped.GroupedExperts stacks every local expert's weights):
    megatron's overlap_param_gather hook only gathers a module's direct parameters when that
    module runs, so without this the stacked weights would be the previous step's on every
    shard but this rank's. Returns the number of hooks installed (0 without the overlap)."""
    installed = 0
    for chunk in chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is None or not (cfg.use_distributed_optimizer and cfg.overlap_param_gather):
            continue
        for module in chunk.module.modules():
            if isinstance(module, GroupedExperts):
                module.register_forward_pre_hook(_subtree_gather_hook(chunk))
                installed += 1
    return installed


def _subtree_gather_hook(chunk):
    def hook(module, *unused):
        for param in module.parameters():
            group = chunk.param_to_bucket_group.get(param)
            if group is not None:
                group.finish_param_sync()   # a no-op once that bucket's gather is done
    return hook


def finish_param_gather(chunks: list) -> int:
    """Make every parameter hold the values of the last optimizer step: waits for the
    parameter all-gathers still in flight and issues (synchronously, over each bucket's DP
    group) those not yet issued. A no-op without overlap_param_gather. Collective over the
    DP x CP group (and the expert-DP group for expert buckets) when a gather is pending, so
    every rank must call it at the same point. Returns the number of buckets gathered now."""
    gathered = 0
    for chunk in chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is None or not (cfg.use_distributed_optimizer and cfg.overlap_param_gather):
            continue
        groups = list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups",
                                                          []))
        for group in groups:
            done = (getattr(group, "param_gather_dispatched", False)
                    and getattr(group, "param_gather_handle", None) is None)
            if not done:
                group.start_param_sync(force_sync=True)
                gathered += 1
    return gathered
