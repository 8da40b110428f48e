"""Which ranks produce image pixels (run on the session's rank pools by
tests/test_vision_decode.py): engine.training.rank_batch.build_rank_batch, as the TrainEngine
calls it, on a global batch whose images are stored (models.vision.inputs.ImageSet.stored of
a source that counts its pixel_values() calls: the decode and the image processor), at the
layout `tp`, `pp` of the pool. Returns per rank its pipeline stage, the decode count, whether
its micro-batches carry images, and their M-RoPE positions.
"""
from __future__ import annotations

IMAGE_TOKEN, MERGE = 7, 2
DECODED = [0]   # this process's pixel_values() calls


class CountingImages:
    """An ImageSource (models.vision.inputs) of one image of grid (1, 4, 2): 8 patches, 2
    placeholder tokens after the 2 x 2 merge; pixel_values() counts its calls."""

    def grid_thw(self):
        import torch

        return torch.tensor([[1, 4, 2]])

    def pixel_values(self):
        import torch

        DECODED[0] += 1
        return torch.ones(8, 12)

    def __reduce__(self):
        return (CountingImages, ())


def _batch() -> list:
    from engine.training.micro_batches import SequenceData
    from models.vision.inputs import ImageSet, SequenceVision

    seqs = []
    for k in range(4):
        ids = [10 + k, 11, IMAGE_TOKEN, IMAGE_TOKEN, 12, 13, 14 + k]
        vision = None
        if k != 1:   # one text-only sequence
            vision = SequenceVision.of(ids[:-1], ImageSet.stored(CountingImages()),
                                       IMAGE_TOKEN, MERGE)
        else:
            ids = ids[:2] + ids[4:]
        seqs.append(SequenceData(ids[:-1], ids[1:], [0] * (len(ids) - 2) + [1],
                                 vision=vision))
    return seqs


def decode_counts(tp: int, pp: int, packing: bool, every_rank: bool = False) -> dict:
    """This rank's {"stage", "decoded", "with_images", "positions"} after building its
    micro-batches. `every_rank`: the negative control, every rank treated as feeding the
    tower (the behaviour before issue 67)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import engine.training.vision_batch as vb
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.training.train_engine import BatchSettings
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))
    original = vb.feeds_tower
    if every_rank:
        vb.feeds_tower = lambda: True
    DECODED[0] = 0
    try:
        batch = build_rank_batch(_batch(), GlobalLossNormalizer("token-sum"),
                                 BatchSettings(micro_batch_size=2, packing=packing))
    finally:
        vb.feeds_tower = original
    mbs = batch.micro_batches
    return {"stage": ps.get_pipeline_model_parallel_rank(), "decoded": DECODED[0],
            "with_images": [mb.vision is not None and mb.vision.images is not None
                            for mb in mbs],
            "positions": [None if mb.vision is None else mb.vision.positions.tolist()
                          for mb in mbs]}
