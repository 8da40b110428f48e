"""A micro-batch's VisionBatch (models.vision.inputs) from its sequences' SequenceVision.

Built by engine.training.micro_batches beside the token tensors, in the same row layout:
- feature_rows: each sequence's placeholder rows shifted past the features of the sequences
  before it in the micro-batch (the tower runs once on all their images, in this order), -1 on
  padding and text; then CP-sharded like the tokens;
- positions: each sequence's M-RoPE positions from 0 (text-only sequences: 0, 1, ... in all
  three), padding continuing from the sequence's last position + 1 (any value would do: real
  tokens never attend to later ones); NOT CP-sharded (models.vision.inputs.VisionBatch).
A micro-batch none of whose sequences has images gets None (the plain 1-D RoPE path).

Pixels are produced (stored images decoded and run through the image processor,
models.vision.inputs.ImageSet) only where the vision tower reads them: on the first pipeline
stage, on every TP rank (the tower is replicated) and every CP rank (each runs it on all the
micro-batch's images) of it. Later stages get the VisionBatch without images (`images`
None): they need the M-RoPE positions only, which come from the images' grids (read from the
data cache, no decoding), and models.vision.model ignores `images` off the first stage.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from models.vision.inputs import ImageSet, VisionBatch
from parallel import zigzag


def feeds_tower() -> bool:
    """Whether this rank runs the vision tower (the first pipeline stage; True without
    megatron's parallel state, i.e. one process)."""
    return (not ps.model_parallel_is_initialized()
            or ps.is_pipeline_first_stage(ignore_virtual=True))


def _images(seqs: list) -> ImageSet | None:
    """The micro-batch's images, their pixels produced, on a rank that feeds the tower; None
    elsewhere (module docstring)."""
    if not feeds_tower():
        return None
    return ImageSet.cat([s.vision.images for s in seqs if s.vision is not None])


def _positions(seq, width: int) -> torch.Tensor:
    """[3, width] positions of one sequence padded to `width` tokens."""
    n = len(seq.tokens)
    out = torch.arange(width).expand(3, width).clone()
    if seq.vision is not None:
        out[:, :n] = seq.vision.positions
        out[:, n:] = torch.arange(width - n) + int(seq.vision.positions.max()) + 1
    return out


def _rows(seq, width: int, offset: int) -> torch.Tensor:
    out = torch.full((width,), -1, dtype=torch.long)
    if seq.vision is not None:
        rows = seq.vision.rows
        out[:len(rows)] = torch.where(rows >= 0, rows + offset, rows)
    return out


def _features(seq) -> int:
    return 0 if seq.vision is None else int((seq.vision.rows >= 0).sum())


def padded_vision(seqs: list, width: int, cp: int, cp_rank: int) -> VisionBatch | None:
    """VisionBatch of a [b, width] micro-batch (engine.training.micro_batches.build_padded)."""
    if all(s.vision is None for s in seqs):
        return None
    rows, offset = [], 0
    for s in seqs:
        rows.append(_rows(s, width, offset))
        offset += _features(s)
    feature_rows = torch.stack(rows)
    if cp > 1:
        feature_rows = zigzag.shard(feature_rows, [width], cp, cp_rank, dim=1)
    positions = torch.stack([_positions(s, width) for s in seqs], dim=1)   # [3, b, width]
    return VisionBatch(_images(seqs), feature_rows, positions)


def packed_vision(seqs: list, seq_lengths: list[int], cp: int, cp_rank: int
                  ) -> VisionBatch | None:
    """VisionBatch of a packed [1, T] row whose segments are `seq_lengths` (the sequences,
    each padded, then maybe one trailing padding segment)."""
    if all(s.vision is None for s in seqs):
        return None
    rows, positions, offset = [], [], 0
    for s, n in zip(seqs, seq_lengths):
        rows.append(_rows(s, n, offset))
        positions.append(_positions(s, n))
        offset += _features(s)
    for n in seq_lengths[len(seqs):]:           # the trailing padding segment
        rows.append(torch.full((n,), -1, dtype=torch.long))
        positions.append(torch.arange(n).expand(3, n))
    feature_rows = torch.cat(rows).unsqueeze(0)
    if cp > 1:
        feature_rows = zigzag.shard(feature_rows, seq_lengths, cp, cp_rank, dim=1)
    return VisionBatch(_images(seqs), feature_rows, torch.cat(positions, dim=1).unsqueeze(1))
