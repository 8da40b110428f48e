"""Synthetic global batches with images for the SFT invariance harness (sft_invariance.py
with INV_IMAGES=1; a model from tests/qwen3_5_tiny.build_qwen3_5_vl), and the packing
negative control of M-RoPE positions.

Each step: GBS sequences, about two in three with one or two random images of grid
(1, h, w), h and w in {2, 4} patches (1 to 4 image tokens after the 2 x 2 merge), between
text tokens; a random trained suffix, never on image tokens; the first sequence of a batch
has no trained token.
"""
from __future__ import annotations

import random

import torch


def vision_batches(hf_config: dict, steps: int, gbs: int, seed: int = 0,
                   image_rows: int | None = None, sides: tuple = (2, 4)) -> list:
    """`steps` global batches of `gbs` sequences (module docstring); `image_rows`: only that
    many sequences of each batch, drawn at random, have images (one or two), the others
    none; `sides`: the image heights and widths (patches) drawn from."""
    from engine.training.micro_batches import SequenceData
    from models.vision.inputs import ImageSet, SequenceVision
    from models.vision.spec import vision_spec

    spec = vision_spec(hf_config)
    v = spec.vision_config
    dim = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    vocab = hf_config["vocab_size"] - 4          # the last four ids are the vision tokens
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        seqs = []
        with_images = set(rng.sample(range(gbs), image_rows)) if image_rows else None
        for i in range(gbs):
            ids, grids = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))], []
            count = rng.choice([0, 1, 1, 2])
            if with_images is not None:
                count = max(count, 1) if i in with_images else 0
            for _ in range(count):
                h, w = rng.choice(sides), rng.choice(sides)
                grids.append([1, h, w])
                ids += ([spec.vision_start_token_id] + [spec.image_token_id] * (h * w // 4)
                        + [spec.vision_end_token_id])
                ids += [rng.randrange(4, vocab) for _ in range(rng.randint(2, 8))]
            n = len(ids) - 1
            start = n if i == 0 else rng.randint(1, n - 1)
            mask = [0 if t < start or ids[t + 1] == spec.image_token_id else 1 for t in range(n)]
            vision = None
            if grids:
                g = torch.tensor(grids)
                pixels = torch.randn(int(g.prod(-1).sum()), dim, generator=gen)
                vision = SequenceVision.of(ids[:-1], ImageSet(pixels, g), spec.image_token_id,
                                           spec.merge_size)
            seqs.append(SequenceData(ids[:-1], ids[1:], mask, vision=vision))
        batches.append(seqs)
    return batches


def misplaced_restarts():
    """Negative control (bug=mrope): packed rows restart each sequence's M-RoPE positions one
    token late (a sequence's first token continues the previous sequence's count), the
    classic off-by-one of a packer. Relative positions inside each sequence change, so the
    loss must differ. Returns an undo function."""
    import engine.training.micro_batches as mbm

    original = mbm.packed_vision

    def late(seqs, seq_lengths, cp, cp_rank):
        vb = original(seqs, seq_lengths, cp, cp_rank)
        if vb is not None:
            starts = torch.tensor([0] + list(seq_lengths)).cumsum(0)[:-1].tolist()
            for a in starts[1:]:
                vb.positions[:, :, a] = vb.positions[:, :, a - 1] + 1
        return vb

    mbm.packed_vision = late
    return lambda: setattr(mbm, "packed_vision", original)
