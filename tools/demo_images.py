"""The image CPU demo's model and data (recipes/vlm_cpu_demo.sh; `python -m tools.demo
counting-data WORK`): nothing is downloaded.

- WORK/init/: a tiny random Qwen3-VL (Qwen3VLForConditionalGeneration: 2 decoder layers of
  width 64, 32-dim heads with M-RoPE, a two-block vision tower on 4-pixel patches merged 2 x 2,
  deepstack from block 0 into layer 0), the word-level tokenizer with the vision tokens
  (tools.tiny_models.build_tokenizer(vision=True)) and transformers' PIL image processor;
- WORK/images/: 32 x 32 pictures of 1 to 4 filled squares (6 x 6 pixels, one random colour per
  picture, random non-overlapping places) on black, drawn here;
- WORK/sft.jsonl: chat rows, an image part and "how many squares ?" -> the count (a digit);
- WORK/rl.jsonl: other pictures as {"prompt": "<image> how many squares ?", "images": [path],
  "answer": count}, for GRPO with the built-in math reward.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

QUESTION = "how many squares ?"
SIDE, SQUARE = 32, 6


def counting_picture(rng: random.Random, count: int):
    """A SIDE x SIDE RGB picture of `count` squares of one random colour on black."""
    from PIL import Image, ImageDraw   # Pillow: only the image demo draws

    picture = Image.new("RGB", (SIDE, SIDE))
    draw = ImageDraw.Draw(picture)
    colour = tuple(rng.randrange(96, 256) for _ in range(3))
    cells = rng.sample([(x, y) for x in range(4) for y in range(4)], count)
    for x, y in cells:   # a 4 x 4 grid of 8-pixel cells, a square somewhere inside each
        left, top = 8 * x + rng.randrange(0, 3), 8 * y + rng.randrange(0, 3)
        draw.rectangle([left, top, left + SQUARE - 1, top + SQUARE - 1], fill=colour)
    return picture


def make_counting_model(out: Path, seed: int = 0) -> None:
    """WORK/init of the module docstring."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.models.qwen3_vl import Qwen3VLConfig

    from tools.tiny_models import build_tokenizer

    vocab = 200
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
                eos_token_id=3, bos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     mrope_section=[6, 5, 5], mrope_interleaved=True))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
                           image_token_id=vocab - 2, video_token_id=vocab - 1)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    build_tokenizer(str(out), vocab, vision=True)
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE).save_pretrained(out)


def make_counting_data(work: Path, sft_rows: int = 800, rl_rows: int = 200,
                       seed: int = 0) -> str:
    """The model, pictures and rows of the module docstring in `work`; returns a summary."""
    rng = random.Random(seed)
    (work / "images").mkdir(parents=True, exist_ok=True)
    make_counting_model(work / "init", seed)

    def picture(i: int) -> tuple[str, int]:
        count = rng.randint(1, 4)
        name = f"images/{i}.png"
        counting_picture(rng, count).save(work / name)
        return name, count

    sft, rl = [], []
    for i in range(sft_rows):
        name, count = picture(i)
        sft.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name},
                                         {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": str(count)}]})
    for i in range(sft_rows, sft_rows + rl_rows):
        name, count = picture(i)
        rl.append({"prompt": f"<image> {QUESTION}", "images": [name], "answer": str(count)})
    for path, rows in ((work / "sft.jsonl", sft), (work / "rl.jsonl", rl)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (f"counting demo in {work}: init/ (tiny Qwen3-VL), {sft_rows} SFT rows, {rl_rows} "
            "RL prompts, pictures of 1 to 4 squares")


def evaluate_counting(models: list[tuple[str, str]], data: str, limit: int) -> None:
    """Greedy answers (transformers' generate, 2 new tokens) of each HF model to the first
    `limit` prompts of the RL rows `data` (their pictures read as the trainer reads them) and
    the accuracy of each, scored by the built-in math reward."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from engine.rl.rewards import math_reward as reward
    rows = [json.loads(line) for line in open(data)][:limit]
    base = Path(data).parent
    for name, path in models:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        proc = AutoImageProcessor.from_pretrained(path, backend="pil")
        right = 0
        for row in rows:
            text = row["prompt"].replace("<image>", "").strip()
            ids = tok.apply_chat_template([{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": " " + text}]}],
                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            pixels = proc(images=[Image.open(base / row["images"][0]).convert("RGB")],
                          return_tensors="pt")
            n = int(pixels["image_grid_thw"].prod()) // 4
            at = ids.index(model.config.image_token_id)
            ids = torch.tensor([ids[:at] + [model.config.image_token_id] * n + ids[at + 1:]])
            with torch.no_grad():
                out = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"],
                                     image_grid_thw=pixels["image_grid_thw"],
                                     mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                     max_new_tokens=2, do_sample=False)
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            right += reward(prompt=text, response=answer, answer=row["answer"]) > 0
        print(f"{name}: greedy accuracy {right / len(rows):.2f} on {len(rows)} pictures",
              flush=True)
