"""One reward-model run: preference pairs, the RM's TrainEngine, the run loop (docs/preference.md).

The model: the HF checkpoint's GPTModel with a score head (models.layers.heads.value, no bias)
on the last pipeline stage, loaded from a *ForSequenceClassification folder or started from a
causal LM with a seeded row (engine.config.rm_settings); with LoRA the adapters train on the
body and the head trains in full (peft's modules_to_save=["score"]). Checkpoints carry the
sequence-classification config (models.bridge.reward_model), so tools/convert.py mcore-to-hf
writes a folder transformers' AutoModelForSequenceClassification loads.

One optimizer step: `train.global_batch_size` PAIRS (layout-independent order over pairs) ->
[c_0, r_0, c_1, r_1, ...] as score sequences (score_sequence) with pair units ->
TrainEngine.train_batch with the Bradley-Terry loss (engine.rm.loss_fn) -> metrics logged by
the RunLoop (metrics.jsonl, TensorBoard).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointing import DataPosition
from engine.config.rm_settings import RMConfig, score_init_std
from engine.data.datasets import Sample, global_batch_indices
from engine.data.preference import PreferencePair
from engine.dpo.training import load_pairs
from engine.rm.loss_fn import REPORT_KEYS, RewardBatch, rm_loss_fn, score_extremes
from engine.rm.scoring import scored_length
from engine.run.run_loop import RunLoop
from engine.run.train_engine_build import build_train_engine
from engine.training.micro_batches import SequenceData
from engine.training.nonfinite import NonFiniteGuard
from engine.training.train_engine import TrainEngine
from models.bridge.critic import SCORE_WEIGHT, TrunkReader
from models.bridge.reward_model import is_reward_model_config, reward_model_hf_config
from models.hf.custom_code import load_tokenizer
from models.hf.io import SafetensorsReader
from models.layers.heads.value import attach_value_heads, seeded_row, value_head


def scored_ids(side: Sample) -> list[int]:
    """The ids a reward model reads of a side: its rendering up to and including its last
    TRAINED token (the last position whose label mask is set: the end-of-turn token of its last
    assistant turn, `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3.1), nothing after it
    (ChatML's trailing newline is not read). They end where RL's prompt + response ids end
    (engine.rl.policy.reward_model), so the token trained here is the token scored there and by
    transformers' sequence classifier after the export. A side cut on the right ends on its last
    kept trained token. A side with no trained token (the preference loader refuses those) is
    read whole. The rule is engine.rm.scoring.scored_length's (the ids' trained flags are the
    label mask shifted by one)."""
    ids = [int(x) for x in side.tokens] + [int(side.labels[-1])]
    return ids[:scored_length([0, *side.loss_mask])]


def score_sequence(side: Sample, pad_id: int) -> SequenceData:
    """A side as the RM reads it: ids = scored_ids(side) as inputs, loss_mask 1 on the last
    position only (the token whose hidden state is scored)."""
    ids = scored_ids(side)
    return SequenceData(ids, ids[1:] + [pad_id], [0] * (len(ids) - 1) + [1])


def pair_sequences(pairs: list[PreferencePair], pad_id: int
                   ) -> tuple[list[SequenceData], list[list[int]]]:
    """(score sequences [c_0, r_0, c_1, r_1, ...], units [[0, 1], [2, 3], ...])."""
    seqs = [score_sequence(side, pad_id) for p in pairs for side in (p.chosen, p.rejected)]
    return seqs, [[2 * k, 2 * k + 1] for k in range(len(pairs))]


def reward_batch(cfg, pairs: list[PreferencePair]) -> RewardBatch:
    margins = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float64)
    return RewardBatch(margins, float(cfg.rm.center_rewards_coefficient or 0.0))


def rm_step(engine: TrainEngine, pairs: list[PreferencePair], cfg) -> dict[str, float]:
    """One optimizer step on the global batch `pairs` (every rank passes the same list);
    returns the metrics, reduced over the whole batch (the same on every layout)."""
    seqs, units = pair_sequences(pairs, engine.pad_id)
    weights = torch.zeros(len(seqs), dtype=torch.float64)   # no token loss: the head's sum
    batch = reward_batch(cfg, pairs)
    out = engine.train_batch(seqs, weights, rm_loss_fn(batch, value_head(engine.chunks)),
                             REPORT_KEYS, units=units)
    tokens, dt = out["batch/num_tokens"], out["time/step_s"]
    return {**{k: out[k] for k in REPORT_KEYS}, **score_extremes(batch),
            "grad_norm": out["grad_norm"], "lr": out["lr"], "num_pairs": len(pairs),
            "num_tokens": int(tokens), "time/step_s": dt,
            "throughput/tokens_per_s": tokens / dt if dt > 0 else 0.0,
            "batch/dp_imbalance": out["batch/dp_imbalance"],
            "batch/padding_fraction": out["batch/num_padding"] / max(
                out["batch/num_padding"] + tokens, 1),
            "train/update_skipped": out["train/update_skipped"],
            "train/skipped_steps": float(engine.guard.skipped),
            **{k: v for k, v in out.items() if k.startswith("moe/")}}


def evaluate(engine: TrainEngine, pairs: list[PreferencePair], cfg) -> dict[str, float]:
    """eval/* metrics: the REPORT_KEYS means over ALL eval pairs (forward-only, in chunks of
    the global batch; each chunk weighted by its share of the pairs), min_reward and
    max_reward over all of them."""
    totals = dict.fromkeys(REPORT_KEYS, 0.0)
    low, high = [], []
    gbs = cfg.train.global_batch_size
    head = value_head(engine.chunks)
    for i in range(0, len(pairs), gbs):
        chunk = pairs[i:i + gbs]
        seqs, units = pair_sequences(chunk, engine.pad_id)
        batch = reward_batch(cfg, chunk)
        out = engine.forward_only(seqs, torch.zeros(len(seqs), dtype=torch.float64),
                                  rm_loss_fn(batch, head), REPORT_KEYS, units=units)
        for k in REPORT_KEYS:
            totals[k] += out[k] * len(chunk) / len(pairs)
        extremes = score_extremes(batch)
        low.append(extremes["min_reward"])
        high.append(extremes["max_reward"])
    totals.update(min_reward=min(low, default=0.0), max_reward=max(high, default=0.0))
    return {f"eval/{k}": v for k, v in totals.items()}


def score_head_setup(cfg, hf_config: dict):
    """(weights reader or None, prepare(raw chunks, load)) for build_train_engine: a
    sequence classifier's trunk and score row, or a causal LM and a seeded new row."""
    path = cfg.model.hf_path
    if is_reward_model_config(hf_config):
        reader = SafetensorsReader(path)
        trunk = TrunkReader(reader, bool(hf_config.get("tie_word_embeddings")))
        return trunk, lambda raw: attach_value_heads(raw, bias=False,
                                                     row=reader.get(SCORE_WEIGHT).float())
    row = seeded_row(hf_config["hidden_size"], score_init_std(cfg, hf_config), cfg.seed)
    return None, lambda raw: attach_value_heads(raw, bias=False, row=row)


def run(cfg: RMConfig, hf_config: dict, flags: list[str]) -> int:
    """The reward-model run on every rank (process groups and megatron state exist)."""
    tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # a side's ids fit train.seq_length: the RM may read every id, the last one included
    dataset, eval_pairs = load_pairs(cfg, tokenizer, "rm", cfg.train.seq_length - 1)
    gbs, n = cfg.train.global_batch_size, len(dataset)

    def position(done: int) -> DataPosition:
        return DataPosition(done, gbs, n, cfg.seed, cfg.data.shuffle)

    reader, prepare = score_head_setup(cfg, hf_config)
    engine, resumed = build_train_engine(cfg, hf_config, pad_id, position(0), "rm",
                                         reader=reader, prepare=prepare, hidden_states=True)
    start = resumed.step
    loop = RunLoop("rm", cfg, engine, reward_model_hf_config(hf_config), position,
                   log_names=("metrics.jsonl",))
    if not loop.prepare(start):
        return 0
    engine.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite_steps,
                                  skipped=start - engine.scheduler.num_steps)
    if dist.get_rank() == 0:
        source = ("its score head" if reader is not None else
                  f"a new score head ~ N(0, {score_init_std(cfg, hf_config):g}^2), seed "
                  f"{cfg.seed}")
        print(f"[rm] reward model: {cfg.model.hf_path} with {source}", flush=True)

    def step_fn(step: int) -> dict:
        idx = global_batch_indices(n, gbs, step, cfg.seed, cfg.data.shuffle)
        metrics = rm_step(engine, [dataset[i] for i in idx], cfg)
        done = step + 1
        metrics["data/consumed_pairs"] = done * gbs
        metrics["data/epoch"] = done * gbs / n
        if eval_pairs is not None and done % cfg.train.eval_interval == 0:
            metrics.update(evaluate(engine, eval_pairs, cfg))
        return metrics

    history = loop.run(start, step_fn)
    if history and dist.get_rank() == 0:
        print(f"[rm] done: {start + len(history)} of {cfg.train.max_steps} steps, first loss "
              f"{history[0]['loss']:.4f}, last loss {history[-1]['loss']:.4f}", flush=True)
    return 0
