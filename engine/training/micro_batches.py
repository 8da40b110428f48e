"""Turn this rank's sequences and their loss weights into model-ready micro-batches.

A `MicroBatch` holds tensors for one forward pass, already cut to this CP rank's zigzag shard:
  padded:  tokens/labels/token_weights/position_ids [b, S/cp]
  packed:  the same as [1, T/cp] plus `packed_seq_params` ("thd", cu_seqlens of the full row;
           parallel.packed_seqs.HostPackedSeqParams: the boundaries as host ints too)
`token_weights` = w_seq(t) * loss_mask(t): the GlobalLossNormalizer weight of the token's
sequence, 0 on padding and untrained tokens. `seq_ids` [.., S/cp] maps tokens to the index of
their sequence in this rank's list (-1 on padding) so per-sequence outputs can be gathered.
`extras` carries per-token RL inputs (old/ref log-probs, advantages; routed experts with a
trailing [layers * k] dimension) sharded the same way: [b, S/cp, ...] / [1, T/cp, ...].
`vision` (models.vision.inputs.VisionBatch; engine.training.vision_batch) carries the images
of a micro-batch whose sequences have some, None otherwise. `tree`
(engine.training.tree_batch.TreeInput, train.prefix_sharing) is what the model runs instead of
`tokens` when the rows share prefixes; every other field stays the unshared rows'.
`dummy` marks a micro-batch of dummy sequences only (`dummy_sequence`: a DP rank with fewer
micro-batches than the others): it carries no token of the batch, so it contributes nothing,
no loss, no router loss (engine.training.router_losses) and no moe/* count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.training.batching import pack_sequences, pad_batch
from engine.training.vision_batch import packed_vision, padded_vision
from models.vision.inputs import SequenceVision, VisionBatch
from parallel import zigzag
from parallel.packed_seqs import packed_seq_params


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    token_weights: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    packed_seq_params: object | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0           # real (unpadded) tokens before CP sharding
    num_padding: int = 0
    vision: VisionBatch | None = None
    tree: object | None = None    # engine.training.tree_batch.TreeInput: the model runs a prefix tree
    dummy: bool = False           # dummy sequences only (module docstring)


@dataclass
class SequenceData:
    """One sequence of a mini-batch as lists of equal length."""
    tokens: list[int]
    labels: list[int]
    loss_mask: list[int]
    weight: float = 0.0
    extras: dict[str, list[float] | torch.Tensor] = field(default_factory=dict)  # per token
    vision: SequenceVision | None = None   # a sequence with images (models.vision)


def _per_token(seq_values: list[float | int], lengths: list[int], total: int,
               dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(total, dtype=dtype)
    start = 0
    for value, n in zip(seq_values, lengths):
        out[start:start + n] = value
        start += n
    return out


def _values(extra) -> torch.Tensor:
    """One sequence's extra as float32 [len, ...] (a list of floats, or a tensor whose rows
    are tokens, e.g. routed experts [len, layers * k]; integers < 2**24 stay exact)."""
    return torch.as_tensor(extra, dtype=torch.float32)


def empty_extras(template: dict, n: int) -> dict[str, torch.Tensor]:
    """Zero extras of `n` tokens shaped like `template`'s (a dummy sequence's)."""
    return {k: torch.zeros(n, *_values(v).shape[1:]) for k, v in template.items()}


def _extras_padded(seqs: list[SequenceData], width: int) -> dict[str, torch.Tensor]:
    keys = seqs[0].extras.keys() if seqs else []
    out = {}
    for k in keys:
        t = torch.zeros(len(seqs), width, *_values(seqs[0].extras[k]).shape[1:])
        for i, s in enumerate(seqs):
            values = _values(s.extras[k])
            t[i, :len(values)] = values
        out[k] = t
    return out


def build_padded(seqs: list[SequenceData], seq_index: list[int], pad_multiple: int,
                 length: int | None, cp: int, cp_rank: int, pad_id: int = 0) -> MicroBatch:
    """A [b, S] micro-batch (S = `length` or the longest, rounded up to pad_multiple)."""
    batch = pad_batch([(s.tokens, s.labels, s.loss_mask) for s in seqs],
                      pad_multiple=pad_multiple, pad_id=pad_id, length=length)
    width = batch["tokens"].shape[1]
    weights = torch.tensor([s.weight for s in seqs], dtype=torch.float32).unsqueeze(1)
    token_weights = batch["loss_mask"].float() * weights
    seq_ids = torch.full((len(seqs), width), -1, dtype=torch.long)
    for row, (s, idx) in enumerate(zip(seqs, seq_index)):
        seq_ids[row, :len(s.tokens)] = idx
    tensors = dict(tokens=batch["tokens"], labels=batch["labels"],
                   token_weights=token_weights, loss_mask=batch["loss_mask"].float(),
                   position_ids=batch["position_ids"], seq_ids=seq_ids)
    extras = _extras_padded(seqs, width)
    if cp > 1:
        tensors = {k: zigzag.shard(v, [width], cp, cp_rank, dim=1) for k, v in tensors.items()}
        extras = {k: zigzag.shard(v, [width], cp, cp_rank, dim=1) for k, v in extras.items()}
    return MicroBatch(**tensors, extras=extras, num_tokens=sum(len(s.tokens) for s in seqs),
                      num_padding=int(batch["num_padding"]),
                      vision=padded_vision(seqs, width, cp, cp_rank), dummy=_dummy(seq_index))


def build_packed(seqs: list[SequenceData], seq_index: list[int], pad_multiple: int,
                 length: int | None, cp: int, cp_rank: int, pad_id: int = 0) -> MicroBatch:
    """A packed [1, T] micro-batch with thd PackedSeqParams; `length` pads the row's tail
    (as one extra masked segment) to a fixed size, needed with pipeline parallelism."""
    row = pack_sequences([(s.tokens, s.labels, s.loss_mask) for s in seqs],
                         pad_multiple=pad_multiple, pad_id=pad_id)
    seq_lengths = list(row.seq_lengths)
    tokens, labels, loss_mask, positions = row.tokens, row.labels, row.loss_mask, row.position_ids
    total = int(tokens.numel())
    num_padding = int(row.num_padding)
    if length is not None and length > total:
        extra = length - total
        tokens = torch.cat([tokens, torch.full((extra,), pad_id, dtype=tokens.dtype)])
        labels = torch.cat([labels, torch.full((extra,), pad_id, dtype=labels.dtype)])
        loss_mask = torch.cat([loss_mask, torch.zeros(extra, dtype=loss_mask.dtype)])
        positions = torch.cat([positions, torch.arange(extra, dtype=positions.dtype)])
        seq_lengths.append(extra)
        num_padding += extra
        total = length
    weights = _per_token([s.weight for s in seqs] + [0.0], seq_lengths, total)
    token_weights = loss_mask.float() * weights
    seq_ids = _per_token(list(seq_index) + [-1], seq_lengths, total, dtype=torch.long)
    start = 0
    for s, n in zip(seqs, seq_lengths):  # padding inside a segment belongs to no sequence
        seq_ids[start + len(s.tokens):start + n] = -1
        start += n
    extras = {}
    for k in (seqs[0].extras.keys() if seqs else []):
        vals = torch.zeros(total, *_values(seqs[0].extras[k]).shape[1:])
        start = 0
        for s, n in zip(seqs, seq_lengths):
            values = _values(s.extras[k])
            vals[start:start + len(values)] = values
            start += n
        extras[k] = vals.unsqueeze(0)
    tensors = dict(tokens=tokens.unsqueeze(0), labels=labels.unsqueeze(0),
                   token_weights=token_weights.unsqueeze(0),
                   loss_mask=loss_mask.float().unsqueeze(0),
                   position_ids=positions.unsqueeze(0), seq_ids=seq_ids.unsqueeze(0))
    if cp > 1:
        tensors = {k: zigzag.shard(v, seq_lengths, cp, cp_rank, dim=1) for k, v in tensors.items()}
        extras = {k: zigzag.shard(v, seq_lengths, cp, cp_rank, dim=1) for k, v in extras.items()}
    bounds = [0]
    for n in seq_lengths:
        bounds.append(bounds[-1] + n)
    params = packed_seq_params(bounds)   # host ints too: no layer reads them back
    return MicroBatch(**tensors, packed_seq_params=params, extras=extras,
                      num_tokens=sum(len(s.tokens) for s in seqs), num_padding=num_padding,
                      vision=packed_vision(seqs, seq_lengths, cp, cp_rank),
                      dummy=_dummy(seq_index))


def _dummy(seq_index: list[int]) -> bool:
    """Whether a micro-batch's sequences are all dummies (index -1: no sequence of the batch)."""
    return all(i < 0 for i in seq_index)


def dummy_sequence(pad_multiple: int, pad_id: int = 0) -> SequenceData:
    """A fully masked sequence for DP ranks that hold fewer micro-batches than the others."""
    n = max(pad_multiple, 1)
    return SequenceData([pad_id] * n, [pad_id] * n, [0] * n, 0.0)
