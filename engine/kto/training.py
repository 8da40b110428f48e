"""One KTO run: unpaired examples, the policy's TrainEngine, the reference, the run loop.

One optimizer step (docs/preference.md, "KTO"): the global batch of step k is
`train.global_batch_size` EXAMPLES (layout-independent order, engine.data.datasets.
global_batch_indices) -> each example one sequence and one planning unit -> the mismatched
sequences (kl_sequences: example i's prompt with example i-1's completion, cyclically over the
global batch in its order, as TRL shifts completions by one) -> the reference's completion
log-prob sums of both, and the policy's of the mismatched ones (forward-only, same layout) ->
the KL reference point (one global number) -> TrainEngine.train_batch with the KTO loss
(engine.kto.loss_fn) -> metrics under TRL's names, logged by the RunLoop. The run, checkpoints,
resume and the reference (a frozen copy of kto.ref_path or model.hf_path; with LoRA the base or
the starting adapter) are the preference core's (engine.preference.run,
engine.preference.reference), as DPO's.

The per-sequence weights passed to train_batch feed nothing but the MTP layer's targets
(model.mtp.enabled; KTO's loss reads none): loss.agg_mode over the DESIRABLE examples'
completion tokens of the global batch, 0 on the undesirable ones (`mtp_weights`), as DPO trains
it on the chosen completions: the draft learns the text the policy is moved towards.
"""
from __future__ import annotations

import time

import torch

from engine.config.kto_settings import KTOConfig
from engine.data.preference_unpaired_dataset import UnpairedExample, load_unpaired_dataset
from engine.kto.loss import KTOLossSettings
from engine.kto.loss_fn import REPORT_KEYS, ExampleBatch, kto_loss_fn, kto_metrics
from engine.preference.reference import Reference, completion_logprob_sums, make_reference
from engine.preference.run import Objective, load_train_eval, run_objective
from engine.preference.step_metrics import step_metrics
from engine.preference.weights import completion_counts, subset_weights
from engine.training.micro_batches import SequenceData
from engine.training.train_engine import TrainEngine


def loss_settings(cfg) -> KTOLossSettings:
    k = cfg.kto
    return KTOLossSettings(k.beta, k.desirable_weight, k.undesirable_weight)


def _ids(example: UnpairedExample) -> tuple[list[int], list[int]]:
    """(rendered ids, trained flags) of an example's Sample."""
    s = example.sample
    return list(s.tokens) + [s.labels[-1]], [0] + list(s.loss_mask)


def example_sequences(examples: list[UnpairedExample]) -> list[SequenceData]:
    return [SequenceData(e.sample.tokens, e.sample.labels, e.sample.loss_mask)
            for e in examples]


def kl_sequences(examples: list[UnpairedExample], seq_length: int) -> list[SequenceData]:
    """The mismatched sequences of a batch: for i = 0..B-1 example i's prompt followed by the
    completion of example (i - 1) mod B (TRL's shift by one: (x_0, y_{B-1}), (x_1, y_0), ...),
    the completion's trained tokens trained, cut to seq_length + 1 ids on the right (the
    prompt, at most seq_length tokens, and the completion's first token always fit)."""
    out = []
    for i, e in enumerate(examples):
        other = examples[i - 1]
        ids, _ = _ids(e)
        other_ids, other_trained = _ids(other)
        p, q = e.prompt_length, other.prompt_length
        full = (ids[:p] + other_ids[q:])[:seq_length + 1]
        trained = ([0] * p + other_trained[q:])[:seq_length + 1]
        out.append(SequenceData(full[:-1], full[1:], trained[1:]))
    return out


def kl_reference_point(engine: TrainEngine, reference: Reference,
                       seqs: list[SequenceData], kl_seqs: list[SequenceData]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the reference's sums of `seqs` [B], kl_terms [B], kl): kl_terms are the policy's minus
    the reference's completion log-prob sums of the mismatched sequences, kl = clamp(their
    mean over the whole batch, min=0) (TRL: `(KL_logps - ref_KL_logps).mean()`, gathered,
    clamped, detached). Forward-only passes; collective over the world; every rank gets the
    same numbers."""
    b = len(seqs)
    singles = [[i] for i in range(2 * b)]
    ref = reference.sums(seqs + kl_seqs, singles)
    policy_kl = completion_logprob_sums(engine, kl_seqs, singles[:b])
    kl_terms = policy_kl - ref[b:]
    return ref[:b], kl_terms, kl_terms.mean().clamp(min=0) if b else torch.zeros(())


def example_batch(cfg, engine: TrainEngine, reference: Reference,
                  examples: list[UnpairedExample]) -> tuple[list[SequenceData], ExampleBatch]:
    """(the sequences, the ExampleBatch) of `examples`, the reference point included."""
    seqs = example_sequences(examples)
    kl_seqs = kl_sequences(examples, cfg.train.seq_length)
    ref, kl_terms, kl = kl_reference_point(engine, reference, seqs, kl_seqs)
    counts = completion_counts(seqs)
    labels = torch.tensor([e.label for e in examples], dtype=torch.bool)
    return seqs, ExampleBatch(loss_settings(cfg), counts, ref, labels, kl, kl_terms)


def mtp_weights(engine: TrainEngine, batch: ExampleBatch, cfg) -> torch.Tensor:
    """[B] the per-sequence weights a step passes to train_batch (module docstring): the MTP
    layer's, loss.agg_mode over the desirable completions; zeros when the engine trains no MTP
    layer (nothing else reads them)."""
    if engine.mtp is None:
        return torch.zeros(batch.num_examples, dtype=torch.float64)
    return subset_weights(batch.counts, batch.labels, cfg.loss, cfg.train.seq_length)


def kto_step(engine: TrainEngine, reference: Reference, examples: list[UnpairedExample],
             cfg) -> dict[str, float]:
    """One optimizer step on the global batch `examples` (every rank passes the same list);
    returns the metrics, reduced over the whole batch (the same on every layout)."""
    t0 = time.perf_counter()
    seqs, batch = example_batch(cfg, engine, reference, examples)
    ref_s = time.perf_counter() - t0
    out = engine.train_batch(seqs, mtp_weights(engine, batch, cfg),
                             kto_loss_fn(batch, engine.vocab_size), REPORT_KEYS,
                             units=[[i] for i in range(len(seqs))])
    return {**kto_metrics(out, batch),
            **step_metrics(out, engine, {"num_examples": len(examples),
                                         "num_desirable": int(batch.labels.sum())}, ref_s)}


def evaluate(engine: TrainEngine, reference: Reference, examples: list[UnpairedExample],
             cfg) -> dict[str, float]:
    """eval/* metrics over ALL eval examples as one batch (forward-only, in the engine's
    micro-batches): the mismatched pairs are formed over the whole eval set in file order and
    its KL reference point is their mean, so every eval/* value is a mean over the whole
    set, whatever the layout."""
    seqs, batch = example_batch(cfg, engine, reference, examples)
    out = engine.forward_only(seqs, torch.zeros(len(seqs), dtype=torch.float64),
                              kto_loss_fn(batch, engine.vocab_size), REPORT_KEYS,
                              units=[[i] for i in range(len(seqs))])
    return {f"eval/{k}": v for k, v in kto_metrics(out, batch).items()}


def build_reference(cfg, hf_config: dict, policy: TrainEngine, pad_id: int) -> Reference:
    """KTO's reference (engine.preference.reference.make_reference: the starting LoRA adapter,
    the LoRA base, or a frozen engine of kto.ref_path); KTO always needs one."""
    return make_reference(cfg, hf_config, policy, pad_id, cfg.kto.ref_path, True)


def load_examples(cfg, tokenizer):
    """(train dataset, eval examples or None) of data.train_files / data.eval_files."""
    return load_train_eval(cfg, tokenizer, load_unpaired_dataset, "kto")


def run(cfg: KTOConfig, hf_config: dict, flags: list[str]) -> int:
    """The KTO run on every rank (process groups and megatron state exist): the preference
    core's loop (engine.preference.run) with KTO's examples, step and reference."""
    k = cfg.kto
    return run_objective(Objective(
        "kto", load_examples, build_reference, kto_step, evaluate,
        lambda reference: f"beta {k.beta}, desirable_weight {k.desirable_weight}, "
                          f"undesirable_weight {k.undesirable_weight}; reference: "
                          f"{reference.describe()}",
        "data/consumed_examples"), cfg, hf_config)
