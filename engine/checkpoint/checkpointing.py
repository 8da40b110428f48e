"""Training checkpoints: save and resume a run exactly, also at another parallel layout.

A checkpoint (Megatron distributed format, `megatron.core.dist_checkpointing`) holds, under
these state-dict keys:

- `model`: {"chunk0": ...} sharded tensors with global, layout-free keys (models.bridge.checkpoint);
- `optimizer`: the Megatron optimizer's sharded state. With the distributed optimizer the
  sharding type is "fully_reshardable": on save, the DP shards of the fp32 master weights and
  Adam moments are gathered (over gloo, onto DP rank 0's host memory) and stored per model
  parameter in model space, so on load they are resharded to any DP/TP/PP/CP (each rank reads
  the full tensors of its TP/PP shard, then keeps its DP slice);
- `scheduler`: OptimizerParamScheduler.state_dict() (its step count sets the LR on load);
- `data`: the data position (DataPosition: optimizer steps done, consumed samples, global batch
  size, dataset size, seed, shuffle). The sample order of step k is a function of these only
  (engine.data.datasets.global_batch_indices), so restoring the step restores the data stream;
- `rng`: per-rank RNG states (python, numpy, torch CPU, torch CUDA, megatron's tracker), one
  ShardedObject element per global rank. They are restored only at the same layout; after a
  layout change they are left as seeded (the SFT step itself draws no random numbers: no
  dropout, data order from the step);
- `layout`, `iteration`, `format_version`: what was saved, for checks and humans;
- `extra` (optional; absent from SFT checkpoints): a dict of plain JSON values a training loop
  needs besides the data position (the RL loop saves its rollout collector's
  `next_gen_batch`). `read_checkpoint_info(dir)["extra"]` returns it ({} when absent).

The directory layout and the atomic-save protocol are engine.checkpoint.io's. Functions here
marked "collective" must be called by every rank of the default process group.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from engine.checkpoint.io import (CheckpointError, iteration_dir, prune, publish,
                                  resolve_resume, staging_dir, write_complete_marker)
from engine.checkpoint.hf_export import ExportExtras, save_hf_export
from engine.checkpoint.rng import capture_rng, restore_rng
from engine.checkpoint.schedule import (ResumeMismatchError, refusal, resume_schedule,
                                        schedule_differences)
from engine.checkpoint.writer import install as install_writer_queue
from engine.checkpoint.fault_injection import maybe_crash
from engine.checkpoint.bucket_padding import optimizer_sharded_state_dict
from engine.training import fused_adamw
from engine.training.adam_steps import own_counters, steps_set_aside
from models.bridge.checkpoint import load_model_state, model_sharded_state_dict, write_metadata

FORMAT_VERSION = 1
# "fully_reshardable": optimizer state gathered per parameter in model space (any DP/TP/PP/CP
# on load); "mem_efficient": gathered over gloo onto DP rank 0's host memory only.
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": True}


@dataclass(frozen=True)
class DataPosition:
    """Where a run stands in its data stream after `step` optimizer steps."""
    step: int                 # optimizer steps done
    global_batch_size: int    # sequences per optimizer step
    num_samples: int          # samples in the training dataset
    seed: int
    shuffle: bool

    @property
    def consumed_samples(self) -> int:
        return self.step * self.global_batch_size

    def mismatches(self, run: "DataPosition",
                   batch_key: str = "train.global_batch_size") -> list[str]:
        """Why this saved position cannot continue `run` (the current configuration);
        `batch_key` names the config key of global_batch_size in the messages."""
        keys = {"global_batch_size": batch_key,
                "num_samples": "the training dataset size (data.train_files)",
                "seed": "seed", "shuffle": "data.shuffle"}
        return [f"{name}: checkpoint has {getattr(self, field)}, this run has "
                f"{getattr(run, field)}" for field, name in keys.items()
                if getattr(self, field) != getattr(run, field)]


# ----------------------------------------------------------------------------- state dict

def current_layout() -> dict:
    """The layout of the current megatron parallel state (world, tp, pp, vpp, cp, dp)."""
    return {"world_size": dist.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            "cp": ps.get_context_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _prepare_optimizer_for_load(optimizer) -> None:
    """Give a fresh distributed optimizer its (dummy) Adam state so that its sharded state
    dict can be built; the loaded values then replace every entry of it (master weights,
    moments, step)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _load_optimizer(optimizer, loaded) -> None:
    """`optimizer.load_state_dict(loaded)`, working around megatron-core 0.16's
    "fully_reshardable" load with torch's Adam (the fallback without TE/apex): torch keeps a
    per-parameter "step" tensor, which that format does not store (the step lives in the param
    groups), and megatron copies every state key (KeyError 'step'). The param groups and step
    are loaded first, the step tensors are set aside while the tensors are copied, then put
    back. Megatron also gives every parameter the same step tensor, which torch's Adam then
    increments once per parameter: each parameter gets its own copy here
    (engine.training.adam_steps). Last, the run's optim.fused setting is applied again
    (engine.training.fused_adamw.reapply): the load brought the saving run's."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    for opt, sd in zip(opts, states):
        if not (isinstance(opt, DistributedOptimizer)
                and sd.get("param_state_sharding_type") == "fully_reshardable"):
            opt.load_state_dict(sd)
            continue
        sd = dict(sd)
        param_state = sd.pop("param_state")
        sd.pop("param_state_sharding_type")
        opt.load_state_dict(sd)
        with steps_set_aside(opt.optimizer):
            opt.load_parameter_state_from_fully_reshardable(param_state)
    own_counters(o.optimizer for o in opts if getattr(o, "optimizer", None) is not None)
    if len(opts) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    fused_adamw.reapply(optimizer)


def _plain_extra(extra: dict) -> dict:
    """A copy of `extra` after checking that it is a dict with str keys whose values survive a
    JSON round trip unchanged (bool, int, float, str, None, lists and dicts of them); raises
    TypeError otherwise."""
    try:
        ok = (isinstance(extra, dict) and all(isinstance(k, str) for k in extra)
              and json.loads(json.dumps(extra)) == extra)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TypeError(f"checkpoint extra must be a dict of plain JSON values, got {extra!r}")
    return json.loads(json.dumps(extra))


def training_state_dict(state, position: DataPosition, is_loading: bool,
                        with_rng: bool = True, extra: Optional[dict] = None) -> dict:
    """The sharded state dict of a TrainState (keys in the module docstring), with `extra`
    (plain JSON values, checked by the caller, the same on every rank) when given. Collective (the optimizer's sharded
    state dict gathers nothing, but must be built on every rank)."""

    if not is_loading and hasattr(state, "gather_params"):
        state.gather_params()   # overlap_param_gather: parameters current before they are saved
    model_sd = model_sharded_state_dict(state.chunks)
    if is_loading:
        _prepare_optimizer_for_load(state.optimizer)
    sd = {
        "model": model_sd["model"],
        "optimizer": optimizer_sharded_state_dict(state.optimizer, model_sd, is_loading,
                                                  SHARDING_METADATA),
        "scheduler": state.scheduler.state_dict(),
        "data": asdict(position),
        "layout": current_layout(),
        "iteration": position.step,
        "format_version": FORMAT_VERSION,
    }
    if extra is not None:
        sd["extra"] = extra
    if with_rng:
        sd["rng"] = ShardedObject("rng_state", capture_rng(), (dist.get_world_size(),),
                                  (dist.get_rank(),), replica_id=0)
    return sd


def common_state_to_compare(common: dict) -> dict:
    """The common state compared across ranks before a save, without the optimizers'
    param_state: with the mem-efficient gather only DP rank 0 holds it (None elsewhere), and
    an optimizer without parameters on a rank (engine.checkpoint.empty_optimizer: the expert
    optimizer of an all-dense pipeline stage) keeps its empty one in the common state, where
    the other stages' is sharded. A chained optimizer's state is {index: one optimizer's}."""
    def strip(opt):
        if isinstance(opt, dict) and "param_state" in opt:
            return {k: v for k, v in opt.items() if k != "param_state"}
        return opt

    opt = common.get("optimizer")
    if isinstance(opt, dict):
        chained = opt and all(isinstance(k, int) for k in opt)
        opt = {k: strip(v) for k, v in opt.items()} if chained else strip(opt)
        common = {**common, "optimizer": opt}
    return common


def _broadcast_error(message: Optional[str]) -> None:
    """Collective: raise CheckpointError on every rank when rank 0 reports `message`."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def save_training_checkpoint(state, root: str | os.PathLike, position: DataPosition,
                             hf_config: dict, tokenizer_dir: Optional[str],
                             keep_last: Optional[int] = None,
                             config_yaml: Optional[str] = None,
                             extra: Optional[dict] = None, save_hf: bool = False,
                             hf_extras: Optional[ExportExtras] = None) -> Path:
    """Collective: save `state` after `position.step` optimizer steps as
    `root/iter_%07d` (atomic, see engine.checkpoint.io), then prune to `keep_last`. `save_hf`
    (checkpoint.save_hf): also its HF folder `hf/` (engine.checkpoint.hf_export; the
    checkpoint's own source files go to `hf_source/`: models.bridge.checkpoint.write_metadata),
    with the run's `hf_extras` (a reward model's scoring files: engine.rm.export).
    `extra`: optional plain JSON values (identical on every rank; rank 0's copy is stored),
    returned by read_checkpoint_info(...)["extra"]; None stores no `extra` key (the SFT
    checkpoint format). Returns the published directory; raises CheckpointError on every rank
    if rank 0 could not verify or publish it (TypeError, before anything is written, when
    `extra` is not plain)."""

    if extra is not None:
        extra = _plain_extra(extra)   # checked before anything is written
    rank = dist.get_rank()
    stage = staging_dir(root, position.step)
    if rank == 0:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    dist.barrier()
    install_writer_queue()   # megatron's writer helper process must die with this rank
    maybe_crash("save", rank, position.step)
    sd = training_state_dict(state, position, is_loading=False, extra=extra)
    # ends with a barrier: every rank's shards are written when it returns
    dist_checkpointing.save(sd, str(stage),
                            preprocess_common_before_consistancy_check=common_state_to_compare)
    error = None
    if rank == 0:
        try:
            write_metadata(stage, hf_config, tokenizer_dir)
            if config_yaml is not None:
                (stage / "config.yaml").write_text(config_yaml)
        except OSError as e:
            error = f"saving {iteration_dir(root, position.step)} failed: {e}"
    if save_hf:  # hf/, as convert mcore-to-hf writes it (engine.checkpoint.hf_export)
        error = save_hf_export(state.chunks, stage, hf_config, tokenizer_dir, error, hf_extras)
    if rank == 0 and error is None:
        try:
            info = {"layout": sd["layout"], "data": sd["data"], **(
                {"extra": extra} if extra is not None else {})}
            write_complete_marker(stage, position.step, info)
            publish(root, position.step)
            for p in prune(root, keep_last):
                print(f"[checkpoint] removed {p} (checkpoint.keep_last={keep_last})",
                      flush=True)
        except (OSError, CheckpointError) as e:
            error = f"saving {iteration_dir(root, position.step)} failed: {e}"
    _broadcast_error(error)
    return iteration_dir(root, position.step)


def read_checkpoint_info(ckpt_dir: str | os.PathLike) -> dict:
    """The non-sharded part of a training checkpoint: data, scheduler, layout, iteration,
    optimizer param groups and `extra` (the plain values given to save_training_checkpoint; {}
    when none were saved). Reads the file system only (no collective)."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    if "data" not in common or "scheduler" not in common:
        raise CheckpointError(f"{ckpt_dir} is a model-only checkpoint (no data position or "
                              "optimizer state); use it as weights, not for checkpoint.resume")
    common.setdefault("extra", {})
    return common


def select_resume_checkpoint(resume: str, root: Optional[str]) -> Optional[Path]:
    """Collective: rank 0 resolves `checkpoint.resume` (engine.checkpoint.io.resolve_resume),
    printing a warning for every torn checkpoint it skips; every rank gets its answer."""
    box: list = [None, None]
    if dist.get_rank() == 0:
        try:
            found = resolve_resume(resume, root,
                                   lambda m: print(f"[checkpoint] warning: {m}", flush=True))
            box[0] = str(found) if found else None
        except CheckpointError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise CheckpointError(box[1])
    return Path(box[0]) if box[0] else None


def load_training_checkpoint(state, ckpt_dir: str | os.PathLike, run_position: DataPosition,
                             batch_key: str = "train.global_batch_size",
                             schedule: str = "same") -> DataPosition:
    """Collective: load model, optimizer, scheduler (and RNG at the same layout) from
    `ckpt_dir` into `state`, built for the current layout. `run_position` describes this run
    (its step is ignored); raises ResumeMismatchError, before anything is loaded, if the
    checkpoint belongs to another data stream (`batch_key`: the config key of the batch size,
    named in that message) or, with `schedule` (checkpoint.schedule) "same", if its LR schedule
    differs from the one `state` was built with (engine.checkpoint.schedule: "checkpoint" keeps
    the checkpoint's, "config" advances this config's to the saved step). Returns the saved
    position: training continues at its `step`. The saved `extra` values, if any, come from
    read_checkpoint_info."""

    info = read_checkpoint_info(ckpt_dir)
    saved = DataPosition(**info["data"])
    problems = saved.mismatches(run_position, batch_key)
    if problems:
        raise ResumeMismatchError(f"cannot resume from {ckpt_dir}: the data stream differs "
                                  "(" + "; ".join(problems) + "); restore those settings, or "
                                  "start over with an empty checkpoint.dir")
    differences = schedule_differences(info["scheduler"], state.scheduler.state_dict())
    if differences and schedule == "same":
        raise ResumeMismatchError(refusal(ckpt_dir, differences, saved.step))
    same_layout = info["layout"] == current_layout()
    sd = training_state_dict(state, saved, is_loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(sd, str(ckpt_dir))
    for i, chunk in enumerate(state.chunks):
        load_model_state(chunk, loaded["model"][f"chunk{i}"])
    _load_optimizer(state.optimizer, loaded["optimizer"])
    schedule_note = resume_schedule(state.scheduler, loaded["scheduler"], schedule)
    if same_layout:
        restore_rng(loaded["rng"])
    if dist.get_rank() == 0:
        note = "" if same_layout else (f" (saved at layout {info['layout']}, RNG states "
                                       "not restored)")
        print(f"[checkpoint] resumed from {ckpt_dir}: {saved.step} steps done, "
              f"{saved.consumed_samples} samples consumed{note}", flush=True)
        if schedule_note:
            print(f"[checkpoint] {schedule_note}", flush=True)
    return saved
