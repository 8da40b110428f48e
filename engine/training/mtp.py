"""The multi-token-prediction (MTP) loss, trained with the model (key `model.mtp.enabled`;
the model part: models.layers.mtp).

Targets, built on the host from each whole sequence before packing and the CP zigzag cut
(`mtp_extras`, per position t of a sequence of n tokens, t < n - 1; zero at t = n - 1):
  mtp_next[t]    = tokens[t + 1]       the token the MTP layer embeds at t
  mtp_labels[t]  = labels[t + 1]       the token it predicts (two ahead of tokens[t])
  mtp_mask[t]    = loss_mask[t + 1]    trained where the main loss trains labels[t + 1]
  mtp_weights[t] = w_seq * mtp_mask[t] the sequence's GlobalLossNormalizer weight

The MTP loss of a step is the main loss's own aggregation applied to the MTP targets:
    mtp/loss = sum over the global batch of mtp_weights[t] * -log p_mtp(mtp_labels[t])
(w_seq is fixed from global counts reduced over DP only: engine.training.loss), so it is the
same at every layout for every loss aggregation mode. The step's loss is
main + `loss_scale` * mtp/loss. `mtp/accuracy` = (targets whose label is the MTP head's argmax)
/ (targets), both counted over the global batch (DP x CP sums, TP copies once).

`detach` (RL): the MTP layer reads the trunk's hidden states, the embedding and the output
head without gradient, so the policy's gradient is exactly the one without MTP; and its
parameters are left out of the global gradient norm (`exclude_from_grad_norm`), so the reported
grad_norm and the clipping coefficient are the policy's own too (the MTP layer is clipped with
the policy's coefficient). The policy's update is then the one without MTP.
"""
from __future__ import annotations

import torch

from engine.training.loss_head import chunked_logprobs_and_hits
from engine.training.micro_batches import MicroBatch, SequenceData
from engine.training.settings import MTPTraining  # noqa: F401 (re-exported)
from models.layers.heads.output import output_weight
from parallel.wrappers import unwrap

MTP_EXTRAS = ("mtp_next", "mtp_labels", "mtp_mask", "mtp_weights")
MTP_REPORT_KEYS = ("mtp/loss", "mtp/correct", "mtp/targets")


def exclude_from_grad_norm(chunks: list) -> int:
    """Tag every MTP parameter of `chunks` (raw GPTModels) `shared = True`, megatron's flag
    for parameters its grad-norm and clipping code skips (it uses it for a pipeline stage's
    copy of the tied embedding); returns how many were tagged."""
    tagged = 0
    for chunk in chunks:
        if getattr(chunk, "mtp_process", False):
            for param in chunk.mtp.parameters():
                param.shared = True
                tagged += 1
    return tagged


def mtp_extras(seq: SequenceData, weight: float) -> dict[str, list[float]]:
    """The MTP target lists of one sequence (module docstring), one entry per token."""
    n = len(seq.tokens)
    shifted = lambda values: [float(v) for v in values[1:n]] + [0.0]  # noqa: E731
    mask = shifted(seq.loss_mask)
    return {"mtp_next": shifted(seq.tokens), "mtp_labels": shifted(seq.labels),
            "mtp_mask": mask, "mtp_weights": [weight * m for m in mask]}


def begin_forward(model, mb: MicroBatch, settings: MTPTraining) -> None:
    """Give the model's MTP block this micro-batch's next tokens (before its forward)."""
    state = unwrap(model).mtp_inputs
    state.next_ids = mb.extras["mtp_next"].long()
    state.detach = settings.detach


def end_forward(model) -> None:
    """Drop the next tokens and the MTP hidden states after the micro-batch's loss."""
    state = unwrap(model).mtp_inputs
    state.next_ids, state.hidden = None, None


def add_mtp_loss(model, mb: MicroBatch, settings: MTPTraining, loss: torch.Tensor,
                 report: dict, vocab_size: int, chunk_tokens: int) -> torch.Tensor:
    """`loss` + loss_scale x this micro-batch's MTP loss sum; adds the MTP_REPORT_KEYS sums to
    `report`. Runs on the last pipeline stage, after the model's forward (models.layers.mtp.
    model stored the MTP hidden states)."""
    state = unwrap(model).mtp_inputs
    hidden = state.hidden
    if hidden is None:
        raise RuntimeError("the MTP block did not run on the last pipeline stage")
    weight = output_weight(model)
    if settings.detach:
        weight = weight.detach()
    labels = mb.extras["mtp_labels"].long()
    real = labels.shape[1]   # hidden may be longer: sequence-parallel padding is dropped
    hidden = hidden[:, :real]
    logp, right = chunked_logprobs_and_hits(hidden, weight, labels, vocab_size, chunk_tokens)
    mtp_sum = -(logp * mb.extras["mtp_weights"]).sum()
    mask = mb.extras["mtp_mask"]
    report["mtp/loss"] = mtp_sum.detach()
    report["mtp/correct"] = (right.float() * mask).sum()
    report["mtp/targets"] = mask.sum()
    return loss + settings.loss_scale * mtp_sum


def mtp_metrics(out: dict) -> dict[str, float]:
    """Pop the MTP sums of a reduced report; returns {"mtp/loss", "mtp/accuracy"}."""
    correct, targets = out.pop("mtp/correct"), out.pop("mtp/targets")
    return {"mtp/loss": out.pop("mtp/loss"),
            "mtp/accuracy": correct / targets if targets > 0 else 0.0}
