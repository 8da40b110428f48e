"""Layout-invariant loss aggregation (docs/design/loss-math.md).

`GlobalLossNormalizer` turns the loss masks of the whole global mini-batch into one weight per
sequence, so that the loss of any micro-batch on any rank is a *plain weighted sum* of its
per-token losses, and the global loss is the sum of those over micro-batches, CP shards and DP
ranks. Modes (n_i trained tokens of sequence i, N = sum n_i, S sequences, H horizon):

  token-mean               w_i = 1 / N
  token-sum                w_i = 1
  seq-mean-token-sum       w_i = 1 / S
  seq-mean-token-mean      w_i = 1 / (n_i S)    (0 when n_i = 0)
  seq-mean-token-sum-norm  w_i = 1 / (S H)      (Dr. GRPO)

Contract with Megatron-Core (tested in tests/test_loss.py and the invariance matrix):
- Counts (N, S) are summed over the **data-parallel group without CP** only. Every CP rank of a
  DP rank holds the same sequences, counted from their *unsharded* masks; TP ranks hold the same
  data; PP stages other than the last compute no loss. None of these copies is counted.
- `TransformerConfig.calculate_per_token_loss=True`: the schedule does not divide a micro-batch
  loss by the micro-batch count, and DDP reduces gradients with a scaling factor of 1 (a sum)
  over the DP x CP group.
- The loss function returns the 3-tuple `(weighted_sum, num_tokens, report)`; megatron's
  `finalize_model_grads` is called with `num_tokens=None` (see `engine.training.train_engine`), so gradients are
  never divided again. The gradient is therefore d(global loss)/d(params) on every layout.
- Side losses (entropy, KL) and logged per-token metrics use the same weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Tokens per chunk of the chunked loss head (engine.training.loss_head; train.loss_chunk_tokens'
# default), chosen by measurement: docs/benchmarks.md "Loss head memory". Defined here, beside
# AGG_MODES, so the config schema reads it without loss_head's megatron-core import.
DEFAULT_LOSS_CHUNK_TOKENS = 1024

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")


def check_agg_mode(mode: str, key: str = "loss.agg_mode") -> str:
    if mode not in AGG_MODES:
        raise ValueError(f"{key}={mode!r} is not a loss aggregation mode; choose one of "
                         f"{', '.join(AGG_MODES)}")
    return mode


def weights_from_counts(token_counts: torch.Tensor, total_tokens: float, total_sequences: float,
                        mode: str, horizon: float | None) -> torch.Tensor:
    """Per-sequence weights [n] (float64) for sequences with `token_counts` [n] trained tokens,
    given the *global* totals N (`total_tokens`) and S (`total_sequences`)."""
    counts = token_counts.to(torch.float64)
    if mode == "token-mean":
        w = torch.full_like(counts, 1.0 / total_tokens if total_tokens > 0 else 0.0)
    elif mode == "token-sum":
        w = torch.ones_like(counts)
    elif mode == "seq-mean-token-sum":
        w = torch.full_like(counts, 1.0 / total_sequences if total_sequences > 0 else 0.0)
    elif mode == "seq-mean-token-mean":
        w = torch.where(counts > 0, 1.0 / (counts.clamp(min=1) * max(total_sequences, 1.0)),
                        torch.zeros_like(counts))
        if total_sequences == 0:
            w.zero_()
    elif mode == "seq-mean-token-sum-norm":
        if not horizon or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive horizon (loss.norm_horizon)")
        w = torch.full_like(counts, 1.0 / (total_sequences * horizon) if total_sequences > 0
                            else 0.0)
    else:
        check_agg_mode(mode)
        raise AssertionError
    return w


class GlobalLossNormalizer:
    """Per-sequence loss weights of one global mini-batch, from counts summed over DP only.

    Args:
        mode: one of AGG_MODES.
        horizon: H of seq-mean-token-sum-norm (e.g. the sequence length).
        count_empty_sequences: whether sequences with no trained token count in S.
        group: the data-parallel process group WITHOUT context parallelism (None: no reduction,
            i.e. this process holds the whole global batch).
    """

    def __init__(self, mode: str, horizon: float | None = None,
                 count_empty_sequences: bool = True, group=None):
        self.mode = check_agg_mode(mode)
        self.horizon = horizon
        self.count_empty_sequences = count_empty_sequences
        self.group = group

    def global_counts(self, local_token_counts: torch.Tensor) -> tuple[float, float]:
        """(N, S) of the global mini-batch; all-reduce (sum) over `self.group`."""
        counts = local_token_counts.to(torch.float64)
        seqs = counts.numel() if self.count_empty_sequences else int((counts > 0).sum())
        totals = torch.tensor([float(counts.sum()), float(seqs)], dtype=torch.float64)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(totals, group=self.group)
        return float(totals[0]), float(totals[1])

    def sequence_weights(self, local_token_counts: torch.Tensor) -> torch.Tensor:
        """Weights [n_local] (float64) for this DP rank's sequences, in the given order.
        Collective over `self.group`: every DP rank must call it once per mini-batch."""
        n_total, s_total = self.global_counts(local_token_counts)
        weights = weights_from_counts(local_token_counts, n_total, s_total, self.mode,
                                      self.horizon)
        if not self.count_empty_sequences:
            weights = torch.where(local_token_counts > 0, weights, torch.zeros_like(weights))
        return weights


def aggregate(token_losses: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """The micro-batch loss: sum over tokens of w_seq(t) * m_t * l_t. `token_weights` already
    holds w_seq(t) * m_t (0 on padding and untrained tokens); same shape as `token_losses`."""
    return (token_losses.float() * token_weights.to(token_losses.device, torch.float32)).sum()
