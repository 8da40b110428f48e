"""Per-sequence weights over a chosen subset of a global batch's completions: the token weights
of DPO's chosen-side NLL and of the MTP layer's targets under DPO and KTO (engine.training.mtp
reads the weights a step passes to TrainEngine.train_batch)."""
from __future__ import annotations

import torch

from engine.training.loss import GlobalLossNormalizer
from engine.training.micro_batches import SequenceData


def completion_counts(seqs: list[SequenceData]) -> torch.Tensor:
    """[n] float64: each sequence's completion (trained) tokens."""
    return torch.tensor([float(sum(s.loss_mask)) for s in seqs], dtype=torch.float64)


def subset_weights(counts: torch.Tensor, selected: torch.Tensor, loss_cfg,
                   seq_length: int) -> torch.Tensor:
    """[n] float64: loss.agg_mode's per-sequence weights (engine.training.loss) over the
    sequences `selected` ([n] bool) of the whole global batch, from their token `counts`; 0 on
    the others. Every rank holds the whole batch, so no collective is needed."""
    normalizer = GlobalLossNormalizer(loss_cfg.agg_mode, loss_cfg.norm_horizon or seq_length,
                                      loss_cfg.count_empty_sequences)
    weights = torch.zeros(counts.numel(), dtype=torch.float64)
    weights[selected] = normalizer.sequence_weights(counts[selected].long())
    return weights
