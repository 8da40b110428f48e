"""Token log-probs of a rollout batch recomputed by the trainer (old policy, KL reference),
forward-only through TrainEngine, and their gap to the rollout engine's log-probs."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.training.micro_batches import SequenceData
from engine.training.token_losses import token_logprobs
from engine.training.train_engine import TrainEngine
from parallel import cpu_runtime


def compute_token_logprobs(engine: TrainEngine, seqs: list[SequenceData],
                           temperature: float) -> torch.Tensor:
    """log p(labels[t]) at temperature T at every trained position (loss_mask 1) of every
    sequence, as a float32 CPU tensor [len(seqs), max length] (0 at every other position: the
    engine's last layer may skip those, models.layers.unread_positions), identical on every
    rank.

    Forward-only in the engine's micro-batches (memory does not grow with the rollout batch).
    Values are placed by (mini-batch position = mb.seq_ids, position within the sequence =
    mb.position_ids), which undoes DP partition, packing and CP zigzag sharding. Only TP rank 0
    of the last pipeline stage writes; the table is summed over the world, so each entry has
    exactly one contributor. Collective over the whole world."""
    width = max(len(s.tokens) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.float32, device=cpu_runtime.device())
    writer = ps.get_tensor_model_parallel_rank() == 0

    def output_fn(logits, mb):
        logp = token_logprobs(logits, mb.labels, engine.vocab_size, temperature)
        if writer:
            valid = (mb.seq_ids >= 0) & (mb.loss_mask > 0)
            table[mb.seq_ids[valid], mb.position_ids[valid]] = logp[valid].to(table.dtype)

    engine.forward_only(seqs, output_fn=output_fn)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.cpu()


def attach_extra(seqs: list[SequenceData], name: str, table: torch.Tensor) -> None:
    """Set seqs[i].extras[name] = table[i, :len(seqs[i].tokens)] (as Python floats)."""
    for i, s in enumerate(seqs):
        s.extras[name] = table[i, :len(s.tokens)].tolist()


def logprob_gap(seqs: list[SequenceData], table: torch.Tensor) -> tuple[float, float]:
    """(mean, max) |rollout log-prob - recomputed log-prob| over the response tokens of `seqs`
    (extras "rollout_logprobs"), `table` from compute_token_logprobs."""
    gaps = []
    for i, s in enumerate(seqs):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        rollout = torch.tensor(s.extras["rollout_logprobs"], dtype=torch.float32)
        gaps.append((rollout - table[i, :len(s.tokens)]).abs()[mask])
    flat = torch.cat(gaps) if gaps else torch.zeros(1)
    return float(flat.mean()), float(flat.max())
