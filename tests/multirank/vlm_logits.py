"""Logits of our megatron model with images against transformers' (one rank; launched by
tests/test_vlm.py):

    python tests/multirank/vlm_logits.py MODEL_DIR

MODEL_DIR: a tiny conditional model made for images (tests/qwen3_5_tiny.build_qwen3_5_vl,
tests/qwen3_vl_tiny.build_qwen3_vl).
Two images of different grids, processed by the folder's image processor (PIL backend),
between text tokens; transformers' Qwen3_5ForConditionalGeneration and our VisionLanguageModel
(one process) on the same ids and pixels. Prints one "RESULT {json}" line: the max abs
difference of the logits (`diff`), their scale, whether our M-RoPE positions equal
transformers' get_rope_index, and two negative controls: the placeholder tokens' own
embeddings instead of the image features (`no_images_diff`), and 1-D positions instead of
M-RoPE (`positions_1d_diff`), and with deepstack (Qwen3-VL) a third: the deepstack features
left out (`no_deepstack_diff`).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def inputs(model_dir: str):
    from PIL import Image
    from transformers import AutoImageProcessor

    from models.hf.io import read_config
    from models.vision.spec import vision_spec

    spec = vision_spec(read_config(model_dir))
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))
              for h, w in [(16, 24), (20, 12)]]
    out = processor(images=images, return_tensors="pt")
    ids = [2, 5, 20, 21]
    for grid in out["image_grid_thw"]:
        ids += ([spec.vision_start_token_id] + [spec.image_token_id] * spec.tokens_per_image(grid)
                + [spec.vision_end_token_id, 22, 23, 24])
    return torch.tensor([ids + [25, 26, 3]]), out["pixel_values"], out["image_grid_thw"], spec


def main() -> None:
    from transformers import AutoModelForImageTextToText

    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader, read_config
    from models.vision.inputs import ImageSet, SequenceVision, VisionBatch
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    model_dir = sys.argv[1]
    ids, pixels, grids, spec = inputs(model_dir)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    mm = (ids == spec.image_token_id).int()
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                 mm_token_type_ids=mm).logits
    hf_positions, _ = hf.model.get_rope_index(ids, mm, image_grid_thw=grids)

    init_distributed()
    setup_model_parallel(ParallelLayout(1))
    cfg = read_config(model_dir)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, SafetensorsReader(model_dir), cfg)
    seq = SequenceVision.of(ids[0], ImageSet(pixels, grids), spec.image_token_id,
                            spec.merge_size)
    vocab = ref.shape[-1]

    def logits(vision):
        with torch.no_grad():
            return chunks[0](ids, torch.arange(ids.shape[1])[None], None,
                             vision=vision)[..., :vocab]

    ours = logits(VisionBatch(seq.images, seq.rows[None], seq.positions[:, None]))
    flat = torch.arange(ids.shape[1]).expand(3, 1, -1)
    result = {"diff": float((ours - ref).abs().max()), "scale": float(ref.abs().max()),
              "positions_equal": bool(torch.equal(hf_positions[:, 0], seq.positions)),
              "no_images_diff": float((logits(None) - ref).abs().max()),
              "positions_1d_diff": float((logits(VisionBatch(seq.images, seq.rows[None], flat))
                                          - ref).abs().max())}
    if spec.deepstack_layers:   # Qwen3-VL: the tower's deepstack features left out
        import models.vision.model as vision_model

        real = vision_model.image_features
        vision_model.image_features = lambda *a: (real(*a)[0], [])
        result["no_deepstack_diff"] = float((logits(VisionBatch(
            seq.images, seq.rows[None], seq.positions[:, None])) - ref).abs().max())
        vision_model.image_features = real
    print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
