"""The run of a preference trainer (DPO, KTO, reward models) on every rank, and its data
loaders: the tokenizer, the train and eval items, the trained engine and the RunLoop (metrics,
checkpoints, resume), the objective's reference, one optimizer step per global batch.

Global batch k holds `train.global_batch_size` items (pairs or examples) in a
layout-independent order (engine.data.datasets.global_batch_indices); each objective's `step`
turns them into sequences and trains them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from engine.checkpoint.checkpointing import DataPosition
from engine.checkpoint.hf_export import ExportExtras
from engine.data.datasets import global_batch_indices
from engine.data.preference import load_preference_dataset
from engine.run.run_loop import RunLoop
from engine.run.train_engine_build import build_train_engine
from engine.training.nonfinite import NonFiniteGuard
from models.hf.custom_code import load_tokenizer


def load_train_eval(cfg, tokenizer, loader, tag: str, seq_length: int | None = None,
                    describe: Callable | None = None):
    """(train dataset, eval items or None) of data.train_files / data.eval_files read by
    `loader(files, tokenizer, seq_length, truncation, cache_dir=, num_workers=)` (default
    train.seq_length); the eval items only with train.eval_interval > 0; rank 0 prints what
    was loaded under `[tag]`, each dataset's `describe(dataset)` (default its describe()).
    DPO's and RM's pairs, KTO's examples."""
    kw = dict(cache_dir=cfg.data.cache_dir, num_workers=cfg.data.num_workers)
    length = seq_length or cfg.train.seq_length
    line = describe or (lambda ds: ds.describe())
    dataset = loader(cfg.data.train_files, tokenizer, length, cfg.data.truncation, **kw)
    eval_items = None
    if cfg.data.eval_files and cfg.train.eval_interval > 0:
        eval_ds = loader(cfg.data.eval_files, tokenizer, length, cfg.data.truncation, **kw)
        eval_items = [eval_ds[i] for i in range(len(eval_ds))]
        if dist.get_rank() == 0:
            print(f"[{tag}] eval data: {line(eval_ds)}", flush=True)
    if dist.get_rank() == 0:
        print(f"[{tag}] train data: {line(dataset)}", flush=True)
    return dataset, eval_items


def load_pairs(cfg, tokenizer, tag: str, seq_length: int | None = None,
               describe: Callable | None = None):
    """(train pairs dataset, eval pairs or None), sides fitted to `seq_length` sample tokens
    (load_train_eval): DPO's and the reward model's preference pairs."""
    return load_train_eval(cfg, tokenizer, load_preference_dataset, tag, seq_length, describe)


@dataclass(frozen=True)
class Objective:
    """What a preference trainer brings to `run_objective`.

    load(cfg, tokenizer) -> (train dataset, eval items or None); reference_of(cfg, hf_config,
    engine, pad_id) -> its reference (engine.preference.reference; None for a reward model);
    step(engine, reference, items, cfg) -> the step's metrics; evaluate(engine, reference,
    eval items, cfg) -> eval/* metrics; banner(reference) -> the line rank 0 prints; `tag`
    names the log lines and the checkpoint's engine; `consumed_key` the items-seen metric;
    engine_options: build_train_engine's extra arguments (a reward model's reader, prepare,
    hidden_states); export_config: the HF config the checkpoints carry (None: the model's);
    hf_extras: what checkpoint.save_hf's folder adds (engine.checkpoint.hf_export.ExportExtras;
    a reward model's scoring files)."""

    tag: str
    load: Callable
    reference_of: Callable
    step: Callable
    evaluate: Callable
    banner: Callable
    consumed_key: str
    engine_options: dict = field(default_factory=dict)
    export_config: dict | None = None
    hf_extras: ExportExtras | None = None


def run_objective(objective: Objective, cfg, hf_config: dict) -> int:
    """The run on every rank (process groups and megatron state exist): optimizer step k trains
    objective.step on global batch k and logs objective.consumed_key and data/epoch, plus
    objective.evaluate every train.eval_interval steps (with eval items)."""
    o, tag = objective, objective.tag
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset, eval_items = o.load(cfg, tokenizer)
    gbs, n = cfg.train.global_batch_size, len(dataset)

    def position(done: int) -> DataPosition:
        return DataPosition(done, gbs, n, cfg.seed, cfg.data.shuffle)

    engine, resumed = build_train_engine(cfg, hf_config, pad_id, position(0), tag,
                                         **o.engine_options)
    start = resumed.step
    loop = RunLoop(tag, cfg, engine, o.export_config or hf_config, position,
                   log_names=("metrics.jsonl",), hf_extras=o.hf_extras)
    if not loop.prepare(start):
        return 0
    engine.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps,
                                  skipped=start - engine.scheduler.num_steps)
    reference = o.reference_of(cfg, hf_config, engine, pad_id)
    if dist.get_rank() == 0:
        print(f"[{tag}] {o.banner(reference)}", flush=True)

    def step_fn(k: int) -> dict:
        idx = global_batch_indices(n, gbs, k, cfg.seed, cfg.data.shuffle)
        metrics = o.step(engine, reference, [dataset[i] for i in idx], cfg)
        done = k + 1
        metrics[o.consumed_key] = done * gbs
        metrics["data/epoch"] = done * gbs / n
        if eval_items is not None and done % cfg.train.eval_interval == 0:
            metrics.update(o.evaluate(engine, reference, eval_items, cfg))
        return metrics

    loop.print_done(start, loop.run(start, step_fn))
    return 0
