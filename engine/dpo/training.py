"""One DPO run: preference pairs, the policy's TrainEngine, the reference, the run loop.

One optimizer step (docs/preference.md): the global batch of step k is `train.global_batch_size`
PAIRS (layout-independent order, engine.data.datasets.global_batch_indices over pairs) ->
the sequence list [c_0, r_0, c_1, r_1, ...] with units [[0, 1], [2, 3], ...] (both sides of a
pair in one micro-batch) -> the reference's completion log-prob sums (forward-only, same
layout, engine.dpo.reference) -> TrainEngine.train_batch with the pair loss
(engine.dpo.loss_fn; orpo adds the chosen sequences' NLL, no reference) -> metrics under TRL's
names, logged by the RunLoop (metrics.jsonl,
TensorBoard). Checkpoints and resume as in SFT (engine.sft.training); the reference is
rebuilt from its HF folder on resume (with LoRA from model.lora.init_from: that adapter
folder, not the checkpoint's adapters).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointing import DataPosition
from engine.config.dpo_settings import DPOConfig
from engine.config.model_settings import megatron_overrides
from engine.config.fusion_settings import fusion_overrides
from engine.config.moe_settings import moe_overrides
from engine.data.datasets import global_batch_indices
from engine.data.preference import PreferencePair, load_preference_dataset
from engine.dpo.loss_fn import PairBatch, dpo_loss_fn, report_keys
from engine.dpo.pair_loss import PairLossSettings
from engine.dpo.reference import Reference
from engine.run.run_loop import RunLoop
from engine.run.train_engine_build import build_train_engine
from engine.training.loss import GlobalLossNormalizer
from engine.training.micro_batches import SequenceData
from engine.training.nonfinite import NonFiniteGuard
from engine.training.train_engine import BatchSettings, TrainEngine
from models.hf.custom_code import load_tokenizer


def pair_sequences(pairs: list[PreferencePair]) -> tuple[list[SequenceData], list[list[int]]]:
    """(sequences [c_0, r_0, c_1, r_1, ...], units [[0, 1], [2, 3], ...]) of `pairs`."""
    seqs = [SequenceData(side.tokens, side.labels, side.loss_mask)
            for p in pairs for side in (p.chosen, p.rejected)]
    return seqs, [[2 * k, 2 * k + 1] for k in range(len(pairs))]


def pair_settings(cfg) -> PairLossSettings:
    d = cfg.dpo
    return PairLossSettings(d.loss_type, d.beta, d.label_smoothing, d.simpo_gamma)


def completion_counts(seqs: list[SequenceData]) -> torch.Tensor:
    """[2P] float64: each sequence's completion (trained) tokens."""
    return torch.tensor([float(sum(s.loss_mask)) for s in seqs], dtype=torch.float64)


def chosen_nll_weights(counts: torch.Tensor, loss_cfg, seq_length: int) -> torch.Tensor:
    """[2P] per-sequence weights of the chosen completions' NLL (loss.agg_mode over the chosen
    sides of the whole global batch, engine.training.loss; 0 on rejected sides), from the
    completion_counts of [c_0, r_0, ...]. Every rank holds the whole batch, so no collective
    is needed."""
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, loss_cfg.norm_horizon or seq_length,
                                      loss_cfg.count_empty_sequences)
    weights = torch.zeros(counts.numel(), dtype=torch.float64)
    weights[0::2] = normalizer.sequence_weights(counts[0::2].long())
    return weights


def orpo_nll_weights(cfg, seqs: list[SequenceData]) -> torch.Tensor | None:
    """[2P] per-sequence weights of ORPO's NLL: loss.agg_mode over EVERY label of the chosen
    sequences of `seqs` (prompt and completion, as TRL's ORPOTrainer; token-mean: 1 / their
    total token count), 0 on rejected sides; None unless dpo.loss_type=orpo."""
    if cfg.dpo.loss_type != "orpo":
        return None
    lengths = torch.tensor([float(len(s.tokens)) for s in seqs], dtype=torch.float64)
    return chosen_nll_weights(lengths, cfg.loss, cfg.train.seq_length)


def step_inputs(cfg, seqs: list[SequenceData], ref: torch.Tensor | None
                ) -> tuple[torch.Tensor, PairBatch]:
    """(the NLL weights, the PairBatch) of one global batch, its counts taken once."""
    counts = completion_counts(seqs)
    return (chosen_nll_weights(counts, cfg.loss, cfg.train.seq_length),
            PairBatch(pair_settings(cfg), counts, ref, cfg.dpo.rpo_alpha or 0.0,
                      sequence_nll_weights=orpo_nll_weights(cfg, seqs)))


def dpo_step(engine: TrainEngine, reference: Reference, pairs: list[PreferencePair],
             cfg) -> dict[str, float]:
    """One optimizer step on the global batch `pairs` (every rank passes the same list);
    returns the metrics, reduced over the whole batch (the same on every layout)."""
    seqs, units = pair_sequences(pairs)
    t0 = time.perf_counter()
    ref = reference.sums(seqs, units)
    ref_s = time.perf_counter() - t0
    weights, batch = step_inputs(cfg, seqs, ref)
    keys = report_keys(batch.settings)
    out = engine.train_batch(seqs, weights, dpo_loss_fn(batch, engine.vocab_size), keys,
                             units=units)
    tokens, dt = out["batch/num_tokens"], out["time/step_s"]
    return {**{k: out[k] for k in keys},
            "grad_norm": out["grad_norm"], "lr": out["lr"], "num_pairs": len(pairs),
            "num_tokens": int(tokens), "time/step_s": dt + ref_s, "time/reference_s": ref_s,
            "throughput/tokens_per_s": tokens / (dt + ref_s) if dt + ref_s > 0 else 0.0,
            "batch/dp_imbalance": out["batch/dp_imbalance"],
            "batch/padding_fraction": out["batch/num_padding"] / max(
                out["batch/num_padding"] + tokens, 1),
            "train/update_skipped": out["train/update_skipped"],
            "train/skipped_steps": float(engine.guard.skipped),
            **{k: v for k, v in out.items() if k.startswith("moe/")}}


def evaluate(engine: TrainEngine, reference: Reference, pairs: list[PreferencePair],
             cfg) -> dict[str, float]:
    """eval/* metrics over ALL eval pairs as one batch (forward-only, in chunks of the global
    batch): the per-pair report_keys are means over all eval pairs, `eval/nll` is the chosen
    completions' NLL aggregated over all eval pairs with loss.agg_mode (token-mean: the sum of
    their token NLLs over their token count; orpo's `eval/nll_loss` the same over every label
    of the chosen sequences), `eval/loss` the mean pair loss plus dpo.rpo_alpha x eval/nll
    (orpo: plus eval/nll_loss), `eval/logits/*` token means over all eval completions. Every
    chunk reports its share of those (PairBatch.report_counts, the whole set's NLL weights),
    so the chunks' reports add up, whatever their sizes."""
    seqs, _ = pair_sequences(pairs)
    counts = completion_counts(seqs)
    weights = chosen_nll_weights(counts, cfg.loss, cfg.train.seq_length)
    orpo = orpo_nll_weights(cfg, seqs)
    settings, rpo = pair_settings(cfg), cfg.dpo.rpo_alpha or 0.0
    keys = report_keys(settings)
    totals = dict.fromkeys(keys, 0.0)
    gbs = cfg.train.global_batch_size
    for i in range(0, len(pairs), gbs):
        chunk, part = seqs[2 * i:2 * (i + gbs)], slice(2 * i, 2 * (i + gbs))
        units = [[2 * k, 2 * k + 1] for k in range(len(chunk) // 2)]
        batch = PairBatch(settings, counts[part], reference.sums(chunk, units), rpo,
                          report_counts=counts,
                          sequence_nll_weights=None if orpo is None else orpo[part])
        out = engine.forward_only(chunk, weights[part], dpo_loss_fn(batch, engine.vocab_size),
                                  keys, units=units)
        for k in keys:
            totals[k] += out[k]
    return {f"eval/{k}": v for k, v in totals.items()}


def make_reference(cfg, hf_config: dict, policy: TrainEngine, pad_id: int,
                   ref_path: str | None, needed: bool) -> Reference:
    """A run's reference (engine.dpo.reference): none (not `needed`), the starting LoRA
    adapter (model.lora.init_from, read from its folder, also on a resume), the LoRA base
    (fresh adapters), or a frozen engine of `ref_path` (default model.hf_path) at the
    policy's layout. DPO's and KTO's (engine.kto.training) references."""
    lora = bool(cfg.model.lora.rank)
    engine = None
    if needed and not lora:
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        engine = TrainEngine.frozen(hf_config, dtype, ref_path or cfg.model.hf_path,
                                    BatchSettings.from_config(cfg.train), pad_id,
                                    loss_chunk_tokens=cfg.train.loss_chunk_tokens or None,
                                    **megatron_overrides(cfg.parallel),
                                    **moe_overrides(cfg, hf_config, forward_only=True),
                                    **fusion_overrides(cfg, hf_config))
    return Reference(policy, engine, lora, needed, cfg.model.lora.init_from)


def build_reference(cfg, hf_config: dict, policy: TrainEngine, pad_id: int) -> Reference:
    """DPO's reference (make_reference): none for a reference-free loss, else dpo.ref_path."""
    return make_reference(cfg, hf_config, policy, pad_id, cfg.dpo.ref_path,
                          pair_settings(cfg).uses_reference)


def load_train_eval(cfg, tokenizer, loader, tag: str, seq_length: int | None = None):
    """(train dataset, eval items or None) of data.train_files / data.eval_files read by
    `loader(files, tokenizer, seq_length, truncation, cache_dir=, num_workers=)` (default
    train.seq_length); the eval items only with train.eval_interval > 0; rank 0 prints what
    was loaded under `[tag]`. DPO's and RM's pairs, KTO's examples."""
    kw = dict(cache_dir=cfg.data.cache_dir, num_workers=cfg.data.num_workers)
    length = seq_length or cfg.train.seq_length
    dataset = loader(cfg.data.train_files, tokenizer, length, cfg.data.truncation, **kw)
    eval_items = None
    if cfg.data.eval_files and cfg.train.eval_interval > 0:
        eval_ds = loader(cfg.data.eval_files, tokenizer, length, cfg.data.truncation, **kw)
        eval_items = [eval_ds[i] for i in range(len(eval_ds))]
        if dist.get_rank() == 0:
            print(f"[{tag}] eval data: {eval_ds.describe()}", flush=True)
    if dist.get_rank() == 0:
        print(f"[{tag}] train data: {dataset.describe()}", flush=True)
    return dataset, eval_items


def load_pairs(cfg, tokenizer, tag: str = "dpo", seq_length: int | None = None):
    """(train pairs dataset, eval pairs or None), sides fitted to `seq_length` sample tokens
    (load_train_eval; engine.rm reads pairs the same way)."""
    return load_train_eval(cfg, tokenizer, load_preference_dataset, tag, seq_length)


def run(cfg: DPOConfig, hf_config: dict, flags: list[str]) -> int:
    """The DPO run on every rank (process groups and megatron state exist)."""
    return run_with_reference(
        "dpo", cfg, hf_config, load_pairs, dpo_step, evaluate, "data/consumed_pairs",
        build_reference, lambda reference: f"loss: {cfg.dpo.loss_type}, beta {cfg.dpo.beta}; "
                                           f"reference: {reference.describe()}")


def run_with_reference(tag: str, cfg, hf_config: dict, load, step, evaluate, consumed_key: str,
                       reference_of, banner) -> int:
    """The run of a trainer with a reference model (DPO; KTO reuses it), on every rank:
    `load(cfg, tokenizer)` -> (train dataset, eval items or None); the policy's TrainEngine and
    RunLoop (`tag` names the log lines and the checkpoint's engine); `reference_of(cfg,
    hf_config, engine, pad_id)`; rank 0 prints `banner(reference)`; optimizer step k trains
    `step(engine, reference, items, cfg)` on global batch k (engine.data.datasets.
    global_batch_indices) and logs `consumed_key` (items seen) and data/epoch, plus
    `evaluate(engine, reference, eval_items, cfg)` every train.eval_interval steps."""
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset, eval_items = load(cfg, tokenizer)
    gbs, n = cfg.train.global_batch_size, len(dataset)

    def position(done: int) -> DataPosition:
        return DataPosition(done, gbs, n, cfg.seed, cfg.data.shuffle)

    engine, resumed = build_train_engine(cfg, hf_config, pad_id, position(0), tag)
    start = resumed.step
    loop = RunLoop(tag, cfg, engine, hf_config, position, log_names=("metrics.jsonl",))
    if not loop.prepare(start):
        return 0
    engine.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps,
                                  skipped=start - engine.scheduler.num_steps)
    reference = reference_of(cfg, hf_config, engine, pad_id)
    if dist.get_rank() == 0:
        print(f"[{tag}] {banner(reference)}", flush=True)

    def step_fn(k: int) -> dict:
        idx = global_batch_indices(n, gbs, k, cfg.seed, cfg.data.shuffle)
        metrics = step(engine, reference, [dataset[i] for i in idx], cfg)
        done = k + 1
        metrics[consumed_key] = done * gbs
        metrics["data/epoch"] = done * gbs / n
        if eval_items is not None and done % cfg.train.eval_interval == 0:
            metrics.update(evaluate(engine, reference, eval_items, cfg))
        return metrics

    history = loop.run(start, step_fn)
    if history and dist.get_rank() == 0:
        print(f"[{tag}] done: {start + len(history)} of {cfg.train.max_steps} steps, first "
              f"loss {history[0]['loss']:.4f}, last loss {history[-1]['loss']:.4f}", flush=True)
    return 0
