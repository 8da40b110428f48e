"""One DPO run: preference pairs, the policy's TrainEngine, the reference, the run loop.

One optimizer step (docs/preference.md): the global batch of step k is `train.global_batch_size`
PAIRS (layout-independent order, engine.data.datasets.global_batch_indices over pairs) ->
the sequence list [c_0, r_0, c_1, r_1, ...] with units [[0, 1], [2, 3], ...] (both sides of a
pair in one micro-batch) -> the reference's completion log-prob sums (forward-only, same
layout, engine.preference.reference) -> TrainEngine.train_batch with the pair loss
(engine.dpo.loss_fn; orpo adds the chosen sequences' NLL, no reference) -> metrics under TRL's
names, logged by the RunLoop (metrics.jsonl, TensorBoard; the run: engine.preference.run).
The per-sequence weights passed to train_batch are the chosen completions' (loss.agg_mode over
them): the `nll` term's and the MTP layer's targets' (model.mtp.enabled). Checkpoints and
resume as in SFT (engine.sft.training); the reference is rebuilt from its HF folder on resume
(with LoRA from model.lora.init_from: that adapter folder, not the checkpoint's adapters).
"""
from __future__ import annotations

import time

import torch

from engine.config.dpo_settings import DPOConfig
from engine.data.preference import PreferencePair
from engine.dpo.loss_fn import PairBatch, dpo_loss_fn, report_keys
from engine.dpo.pair_loss import PairLossSettings
from engine.preference.evaluation import evaluate_in_chunks
from engine.preference.reference import Reference, make_reference
from engine.preference.run import Objective, load_pairs, run_objective
from engine.preference.step_metrics import step_metrics
from engine.preference.weights import completion_counts, subset_weights
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import TrainEngine


def pair_sequences(pairs: list[PreferencePair]) -> tuple[list[SequenceData], list[list[int]]]:
    """(sequences [c_0, r_0, c_1, r_1, ...], units [[0, 1], [2, 3], ...]) of `pairs`."""
    seqs = [SequenceData(side.tokens, side.labels, side.loss_mask)
            for p in pairs for side in (p.chosen, p.rejected)]
    return seqs, [[2 * k, 2 * k + 1] for k in range(len(pairs))]


def pair_settings(cfg) -> PairLossSettings:
    d = cfg.dpo
    return PairLossSettings(d.loss_type, d.beta, d.label_smoothing, d.simpo_gamma)


def chosen_nll_weights(counts: torch.Tensor, loss_cfg, seq_length: int) -> torch.Tensor:
    """[2P] per-sequence weights of the chosen completions' NLL (loss.agg_mode over the chosen
    sides of the whole global batch, engine.preference.weights; 0 on rejected sides), from the
    completion_counts of [c_0, r_0, ...]."""
    chosen = torch.arange(counts.numel()) % 2 == 0
    return subset_weights(counts, chosen, loss_cfg, seq_length)


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
    return {**{k: out[k] for k in keys},
            **step_metrics(out, engine, {"num_pairs": len(pairs)}, ref_s)}


def evaluate(engine: TrainEngine, reference: Reference, pairs: list[PreferencePair],
             cfg) -> dict[str, float]:
    """eval/* metrics over ALL eval pairs as one batch (forward-only, in chunks of the global
    batch): the per-pair report_keys are means over all eval pairs, `eval/nll` is the chosen
    completions' NLL aggregated over all eval pairs with loss.agg_mode (token-mean: the sum of
    their token NLLs over their token count; orpo's `eval/nll_loss` the same over every label
    of the chosen sequences), `eval/loss` the mean pair loss plus dpo.rpo_alpha x eval/nll
    (orpo: plus eval/nll_loss), `eval/logits/*` token means over all eval completions. Every
    chunk reports its share of those (PairBatch.report_counts, the whole set's NLL weights),
    so the chunks' reports add up, whatever their sizes (engine.preference.evaluation)."""
    seqs, _ = pair_sequences(pairs)
    counts = completion_counts(seqs)
    weights = chosen_nll_weights(counts, cfg.loss, cfg.train.seq_length)
    orpo = orpo_nll_weights(cfg, seqs)
    settings, rpo = pair_settings(cfg), cfg.dpo.rpo_alpha or 0.0
    keys = report_keys(settings)

    def run_chunk(i: int, chunk: list[PreferencePair]) -> dict:
        part = slice(2 * i, 2 * (i + len(chunk)))
        chunk_seqs, units = pair_sequences(chunk)
        batch = PairBatch(settings, counts[part], reference.sums(chunk_seqs, units), rpo,
                          report_counts=counts,
                          sequence_nll_weights=None if orpo is None else orpo[part])
        return engine.forward_only(chunk_seqs, weights[part],
                                   dpo_loss_fn(batch, engine.vocab_size), keys, units=units)

    totals = evaluate_in_chunks(pairs, cfg.train.global_batch_size, keys, run_chunk)
    return {f"eval/{k}": v for k, v in totals.items()}


def build_reference(cfg, hf_config: dict, policy: TrainEngine, pad_id: int) -> Reference:
    """DPO's reference (make_reference): none for a reference-free loss, else dpo.ref_path."""
    return make_reference(cfg, hf_config, policy, pad_id, cfg.dpo.ref_path,
                          pair_settings(cfg).uses_reference)


def run(cfg: DPOConfig, hf_config: dict, flags: list[str]) -> int:
    """The DPO run on every rank (process groups and megatron state exist):
    engine.preference.run with DPO's pairs, step, evaluation and reference."""
    return run_objective(Objective(
        "dpo", lambda cfg, tokenizer: load_pairs(cfg, tokenizer, "dpo"), build_reference,
        dpo_step, evaluate,
        lambda reference: f"loss: {cfg.dpo.loss_type}, beta {cfg.dpo.beta}; "
                          f"reference: {reference.describe()}",
        "data/consumed_pairs"), cfg, hf_config)
