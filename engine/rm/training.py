"""One reward-model run: preference pairs, the RM's TrainEngine, the run loop (docs/preference.md).

The model: the HF checkpoint's GPTModel with a score head (models.layers.heads.value, no bias)
on the last pipeline stage, loaded from a *ForSequenceClassification folder or started from a
causal LM with a seeded row (engine.config.rm_settings); with LoRA the adapters train on the
body and the head trains in full (peft's modules_to_save=["score"]). Checkpoints carry the
sequence-classification config (models.bridge.reward_model), so tools/convert.py mcore-to-hf
writes a folder transformers' AutoModelForSequenceClassification loads; with
checkpoint.save_hf every checkpoint holds that folder (its scoring files: engine.rm.export).

One optimizer step: `train.global_batch_size` PAIRS (layout-independent order over pairs) ->
[c_0, r_0, c_1, r_1, ...] as score sequences (score_sequence) with pair units ->
TrainEngine.train_batch with the Bradley-Terry loss (engine.rm.loss_fn) -> metrics logged by
the RunLoop (metrics.jsonl, TensorBoard). The run loop, the data loaders and the chunked
evaluation are the preference core's (engine.preference), as DPO's and KTO's; a reward model
has no reference. It trains no MTP layer: model.mtp.enabled=true is refused
(engine.config.rm_settings.rm_problems).
"""
from __future__ import annotations

import torch

from engine.config.rm_settings import RMConfig, score_init_std
from engine.data.datasets import Sample
from engine.data.preference import PreferenceDataset, PreferencePair
from engine.preference.evaluation import evaluate_in_chunks
from engine.preference.run import Objective, load_pairs, run_objective
from engine.preference.step_metrics import step_metrics
from engine.rm.export import hf_extras
from engine.rm.loss_fn import REPORT_KEYS, RewardBatch, rm_loss_fn, score_extremes
from engine.rm.scoring import scored_length
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import TrainEngine
from models.bridge.critic import SCORE_WEIGHT, TrunkReader
from models.bridge.reward_model import is_reward_model_config, reward_model_hf_config
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


def reward_batch(cfg, pairs: list[PreferencePair], total_pairs: int | None = None
                 ) -> RewardBatch:
    """The RewardBatch of `pairs`; `total_pairs`: the pairs its reports average over (None:
    these)."""
    margins = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float64)
    return RewardBatch(margins, float(cfg.rm.center_rewards_coefficient or 0.0),
                       total_pairs=total_pairs)


def rm_step(engine: TrainEngine, pairs: list[PreferencePair], cfg) -> dict[str, float]:
    """One optimizer step on the global batch `pairs` (every rank passes the same list);
    returns the metrics, reduced over the whole batch (the same on every layout)."""
    seqs, units = pair_sequences(pairs, engine.pad_id)
    weights = torch.zeros(len(seqs), dtype=torch.float64)   # no token loss: the head's sum
    batch = reward_batch(cfg, pairs)
    out = engine.train_batch(seqs, weights, rm_loss_fn(batch, value_head(engine.chunks)),
                             REPORT_KEYS, units=units)
    return {**{k: out[k] for k in REPORT_KEYS}, **score_extremes(batch),
            **step_metrics(out, engine, {"num_pairs": len(pairs)})}


def evaluate(engine: TrainEngine, pairs: list[PreferencePair], cfg) -> dict[str, float]:
    """eval/* metrics: the REPORT_KEYS means over ALL eval pairs (forward-only, in chunks of the
    global batch, each reporting its share of the whole set's means:
    engine.preference.evaluation), min_reward and max_reward over all of them."""
    low, high = [], []
    head = value_head(engine.chunks)

    def run_chunk(_, chunk: list[PreferencePair]) -> dict:
        seqs, units = pair_sequences(chunk, engine.pad_id)
        batch = reward_batch(cfg, chunk, total_pairs=len(pairs))
        out = engine.forward_only(seqs, torch.zeros(len(seqs), dtype=torch.float64),
                                  rm_loss_fn(batch, head), REPORT_KEYS, units=units)
        extremes = score_extremes(batch)
        low.append(extremes["min_reward"])
        high.append(extremes["max_reward"])
        return out

    totals = evaluate_in_chunks(pairs, cfg.train.global_batch_size, REPORT_KEYS, run_chunk)
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


def data_line(dataset: PreferenceDataset, cfg) -> str:
    """The run log's line on a pair dataset: a reward model reads every id of a side, the last
    one included, so its sides are fitted to train.seq_length IDS (train.seq_length - 1 sample
    tokens: engine.preference.run.load_pairs), and the line says so."""
    return dataset.describe(f"train.seq_length={cfg.train.seq_length} ids")


def load_rm_pairs(cfg, tokenizer):
    """(train pairs dataset, eval pairs or None), each side at most train.seq_length ids."""
    return load_pairs(cfg, tokenizer, "rm", cfg.train.seq_length - 1,
                      describe=lambda dataset: data_line(dataset, cfg))


def run(cfg: RMConfig, hf_config: dict, flags: list[str]) -> int:
    """The reward-model run on every rank (process groups and megatron state exist): the
    preference core's loop (engine.preference.run) with the RM's pairs, step and evaluation, a
    score head on the trained engine and no reference."""
    reader, prepare = score_head_setup(cfg, hf_config)
    source = ("its score head" if reader is not None else
              f"a new score head ~ N(0, {score_init_std(cfg, hf_config):g}^2), seed {cfg.seed}")
    return run_objective(Objective(
        "rm", load_rm_pairs, lambda *_: None,
        lambda engine, _, pairs, cfg: rm_step(engine, pairs, cfg),
        lambda engine, _, pairs, cfg: evaluate(engine, pairs, cfg),
        lambda _: f"reward model: {cfg.model.hf_path} with {source}", "data/consumed_pairs",
        engine_options=dict(reader=reader, prepare=prepare, hidden_states=True),
        export_config=reward_model_hf_config(hf_config), hf_extras=hf_extras()), cfg, hf_config)
