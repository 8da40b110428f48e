"""Image pixels are produced only where the vision tower reads them (engine.training.
vision_batch, docs/vlm.md): on the first pipeline stage, every TP rank of it; a later stage
gets the micro-batch's M-RoPE positions (from the images' grids) without decoding. Counted on
2-rank pools (tests/multirank/vision_decode_check.py) through build_rank_batch, padded and
packed; the model's forward with images only on stage 0 is tests/test_vlm.py's PP2 layouts
(equal to one process)."""
from __future__ import annotations

import pytest

IMAGES = 3   # sequences with one image each in the global batch (vision_decode_check._batch)


@pytest.mark.parametrize("packing", [False, True])
def test_only_the_first_pipeline_stage_decodes(pools, packing):
    """PP2: stage 0 decodes each of the batch's 3 images once, stage 1 none, and both hold the
    same M-RoPE positions. Negative control: with every rank treated as feeding the tower
    (the old behaviour), stage 1 decodes them too."""
    target = "tests.multirank.vision_decode_check:decode_counts"
    first, later = sorted(pools.run(2, target, 1, 2, packing), key=lambda r: r["stage"])
    assert (first["stage"], later["stage"]) == (0, 1)
    assert first["decoded"] == IMAGES and any(first["with_images"]), first
    assert later["decoded"] == 0 and not any(later["with_images"]), later
    assert later["positions"] == first["positions"] and any(later["positions"])
    old = sorted(pools.run(2, target, 1, 2, packing, every_rank=True), key=lambda r: r["stage"])
    assert old[1]["decoded"] == IMAGES, old


def test_every_tensor_parallel_rank_of_the_first_stage_decodes(pools):
    """TP2 (the tower is replicated over TP): both ranks decode every image."""
    ranks = pools.run(2, "tests.multirank.vision_decode_check:decode_counts", 2, 1, False)
    assert [r["decoded"] for r in ranks] == [IMAGES, IMAGES]
    assert all(any(r["with_images"]) for r in ranks)
