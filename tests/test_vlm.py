"""Images in SFT (docs/vlm.md) on tiny Qwen3.5 models made for images (tests/qwen3_5_tiny.py
build_qwen3_5_vl):

- in-process: our M-RoPE positions equal transformers' get_rope_index (several layouts) and
  refuse placeholders that do not match the grids; 1-D text positions give megatron's own RoPE
  angles; rows with images in both formats (content parts, an images column with <image>)
  render to expanded, untrained placeholders and the processor's pixels, cached; every bad
  row stops with its file:line;
- one rank: logits equal transformers' Qwen3_5ForConditionalGeneration with two images
  (1e-5), with two negative controls (no image features, 1-D positions);
- the layout matrix (tests/multirank/sft_invariance.py with INV_IMAGES=1: 3 steps, the tower
  trained): TP2+SP, PP2, CP2, packing, CP2 with packing, DP2, and for the MoE variant EP2 equal
  one process (loss, grad norm, final weights with the tower: rel 1e-5, the token embedding
  1e-4: test_layouts_equal_one_process says why); negative controls: packed M-RoPE positions
  restarted one token late, and SP without the sequence_parallel tags; Qwen3-VL with the
  overlapped gradient reduction where some ranks' micro-batches have no image, at one
  process and DP2, with the crash the tower's zero pass fixes as negative control (and the
  zero pass in-process: exactly 0, a zero gradient for every tower parameter);
- HF -> mcore -> HF is bitwise with the tower; engine.sft with images from a jsonl (paths)
  and a parquet (bytes) trains, and with model.vision.freeze=false its export changes the
  tower.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launch import result_lines, run_cli
from tests.qwen3_5_tiny import build_qwen3_5_vl, write_png
from tests.qwen3_vl_tiny import build_qwen3_vl
from tests.test_qwen3_5 import _tensors, convert_round_trip

TOL = 1e-5
# The input token embedding's final weights are bounded by EMBEDDING_TOL, every other tensor by
# TOL (test_layouts_equal_one_process says why)
EMBEDDING_TOL = 1e-4
CONVERT = "tools/convert.py"
SFT = "tests/multirank/sft_invariance.py"
ONE = "modes=token-mean"
# Qwen3.5 dense, its MoE variant (moe), Qwen3-VL (m=vl3: deepstack) and Qwen3-VL-MoE (m=vl3m:
# fused experts on disk)
LAYOUTS = ["2,1,0,1,16,sp", "2,1,0,1,16", "1,2,0,1,4", "1,1,0,2,16", "1,1,0,1,16,packing",
           "1,1,0,2,16,packing", "1,1,0,1,4", "2,1,0,1,3,sp+recompute=full",
           "1,1,0,1,4,moe+ep=2", "2,1,0,1,16,m=vl3+sp", "1,2,0,1,4,m=vl3",
           "1,1,0,2,16,m=vl3+packing", "1,1,0,1,4,m=vl3", "1,1,0,1,4,m=vl3m+ep=2",
           "2,1,0,1,16,m=vl3m+sp"]
CONTROLS = ["1,1,0,1,16,packing+bug=mrope", "2,1,0,1,16,sp+bug=spnorm"]
# The trained tower under the overlapped gradient reduction (ov), on batches where one sequence
# has images (oneimage): at DP2 one rank's micro-batches are all text-only in steps 1 and 2
OVERLAP = ["1,1,0,1,4,m=vl3+oneimage+ov"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {"dense": Path(build_qwen3_5_vl(str(root / "dense"))),
            "moe": Path(build_qwen3_5_vl(str(root / "moe"), moe=True)),
            "vl3": Path(build_qwen3_vl(str(root / "vl3"))),
            "vl3m": Path(build_qwen3_vl(str(root / "vl3m"), moe=True))}


# ----------------------------------------------------------------------------- in-process

@pytest.mark.parametrize("grids", [[[1, 4, 6], [1, 4, 4]], [[1, 2, 8]], [[1, 6, 2], [1, 2, 2]]])
def test_positions_equal_transformers(models, grids):
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    from models.vision.positions import PlaceholderMismatch, mrope_positions

    cfg = AutoConfig.from_pretrained(models["dense"])
    image = cfg.image_token_id
    ids = [2, 5, 20]
    for t, h, w in grids:
        ids += ([cfg.vision_start_token_id] + [image] * (t * h * w // 4)
                + [cfg.vision_end_token_id, 21])
    ids = torch.tensor([ids + [3]])
    grid = torch.tensor(grids)
    ref, _ = Qwen3_5Model.get_rope_index(SimpleModel(cfg), ids, (ids == image).int(),
                                         image_grid_thw=grid)
    assert torch.equal(mrope_positions(ids[0], grid, image, 2), ref[:, 0])
    with pytest.raises(PlaceholderMismatch, match="needs"):          # a grid twice as tall
        mrope_positions(ids[0], grid * torch.tensor([1, 2, 1]), image, 2)
    with pytest.raises(PlaceholderMismatch, match="but only"):       # an image short
        mrope_positions(ids[0], grid[:-1], image, 2)


class SimpleModel:
    """What get_rope_index reads of its model: config and the vision position helper."""

    def __init__(self, cfg):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

        self.config = cfg
        self.get_vision_position_ids = lambda *a, **k: Qwen3_5Model.get_vision_position_ids(
            self, *a, **k)


@pytest.mark.parametrize("kind", ["dense", "vl3"])
def test_tower_zero_pass_is_zero_and_reaches_every_parameter(models, kind):
    """models.vision.tower.zero_pass (a text-only micro-batch with the tower trained): exactly
    0.0, and every tower parameter (Qwen3-VL's deepstack mergers too) gets a gradient, all
    zeros; the same pass without the factor 0 moves every parameter (it reaches them all)."""
    from models.hf.io import read_config
    from models.vision.spec import vision_spec
    from models.vision.tower import build_tower, image_features, zero_pass

    cfg = read_config(models[kind])
    tower = build_tower(cfg, torch.float32, trainable=True)
    zero = zero_pass(tower, vision_spec(cfg))
    assert zero.item() == 0.0 and zero.dim() == 0
    zero.backward()
    grads = {n: p.grad for n, p in tower.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values()), [
        n for n, g in grads.items() if g is None or g.any()]
    assert any("deepstack" in n for n in grads) == (kind == "vl3")
    tower.zero_grad(set_to_none=True)
    features, deepstack = image_features(tower, torch.randn(4, 3 * 2 * 4 * 4),
                                         torch.tensor([[1, 2, 2]]))
    sum(f.sum() for f in (features, *deepstack)).backward()
    assert all(p.grad is not None and p.grad.any() for p in tower.parameters())


def test_text_positions_are_megatrons_rope():
    from models.vision.rope import interleaved_angles

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    pos = torch.arange(11)
    emb = interleaved_angles(pos.expand(3, 1, -1), inv_freq, (3, 3, 2))
    freqs = torch.outer(pos.float(), inv_freq)
    assert torch.equal(emb[:, 0, 0], torch.cat([freqs, freqs], -1))
    moved = interleaved_angles(torch.stack([pos, pos + 1, pos]).unsqueeze(1), inv_freq, (3, 3, 2))
    assert not torch.equal(moved, emb)       # the height section does move


def _dataset(models, tmp_path, rows, seq_length=64, text_model=False):
    from transformers import AutoTokenizer

    from engine.data.datasets import load_sft_dataset
    from engine.data.images import image_context
    from models.hf.io import read_config
    from models.vision.spec import vision_spec

    data, text = tmp_path / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
    if not data.is_file() or data.read_text() != text:   # the cache key holds its mtime
        data.write_text(text)
    ctx = None if text_model else image_context(str(models["dense"]),
                                                vision_spec(read_config(models["dense"])))
    tok = AutoTokenizer.from_pretrained(models["dense"])
    return load_sft_dataset([str(data)], tok, seq_length, cache_dir=str(tmp_path / "cache"),
                            num_workers=0, images=ctx)


def test_rows_with_images_render_and_cache(models, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    write_png(tmp_path / "a.png", 16, 24, 0)
    write_png(tmp_path / "b.png", 12, 12, 1)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                       {"type": "text", "text": "what is it ?"}]},
                          {"role": "assistant", "content": "it is 1"}]},
            {"prompt": "<image> and <image> sum", "images": ["b.png", "a.png"],
             "response": "2"},
            {"messages": [{"role": "user", "content": "what is 1 ?"},
                          {"role": "assistant", "content": "1"}]}]
    ds = _dataset(models, tmp_path, rows)
    proc = AutoImageProcessor.from_pretrained(models["dense"], backend="pil")
    want = proc(images=[Image.open(tmp_path / "b.png").convert("RGB"),
                        Image.open(tmp_path / "a.png").convert("RGB")], return_tensors="pt")
    s = ds[1]
    assert torch.equal(s.vision.images.pixel_values, want["pixel_values"])
    assert s.vision.images.grid_thw.tolist() == want["image_grid_thw"].tolist() == [[1, 4, 4],
                                                                                   [1, 4, 6]]
    image = 198
    assert sum(t == image for t in s.tokens) == 4 + 6          # 16 and 24 patches, merged 2x2
    assert all(m == 0 for t, m in zip(s.labels, s.loss_mask) if t == image)
    assert ds[0].vision.images.grid_thw.tolist() == [[1, 4, 6]] and ds[2].vision is None
    again = _dataset(models, tmp_path, rows)                   # mapped from the cache
    assert again.cache_path == ds.cache_path and torch.equal(
        again[1].vision.images.pixel_values, s.vision.images.pixel_values)


def _pictures(root: Path) -> list[Path]:
    """A JPEG turned by its EXIF orientation, a smooth PNG and a grayscale one (each smaller
    as a file than its RGB pixels) and a noise PNG (larger)."""
    from PIL import Image

    smooth = np.linspace(0, 255, 20 * 28 * 3).reshape(20, 28, 3).astype("uint8")
    exif = Image.Exif()
    exif[0x0112] = 6                                  # rotated: 28 x 20 after load_image
    Image.fromarray(smooth).save(root / "turned.jpg", exif=exif, quality=90)
    Image.fromarray(smooth[::-1]).save(root / "smooth.png")
    Image.fromarray(smooth[:, :, 0]).save(root / "gray.png")
    return [root / "turned.jpg", root / "smooth.png", root / "gray.png",
            write_png(root / "noise.png", 16, 24, 3)]


def test_cache_holds_images_and_the_processor_is_exact(models, tmp_path):
    """The cache keeps each image as its file (or, when smaller, its RGB pixels: never more than
    h x w x 3 bytes), not the processor's float32 patches; the pixels produced when a batch is
    built, and by an RL prompt after pickling (a reference into the cache: no pixels cross
    ranks), are bitwise transformers' processor on the same files (its load_image)."""
    import pickle

    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.image_utils import load_image

    from engine.data.datasets import load_prompt_rows
    from engine.data.images import image_context
    from models.hf.io import read_config
    from models.vision.spec import vision_spec

    files = _pictures(tmp_path)
    names = [f.name for f in files]
    proc = AutoImageProcessor.from_pretrained(models["dense"], backend="pil")
    want = proc(images=[load_image(str(f)) for f in files], return_tensors="pt")
    ds = _dataset(models, tmp_path, [{"prompt": "<image> " * 4 + "what", "images": names,
                                      "response": "1"}], seq_length=160)
    got = ds[0].vision.images
    assert torch.equal(got.pixel_values, want["pixel_values"])
    assert torch.equal(got.grid_thw, want["image_grid_thw"])
    assert got.grid_thw[:2, 1:].tolist() == [[8, 4], [4, 8]]        # the JPEG turned upright
    index = np.load(Path(ds.cache_path) / "image_index.npy")       # offset, bytes, raw, w, h
    assert index[:, 2].tolist() == [0, 0, 0, 1]                     # the files; noise as RGB
    assert all(index[:, 1] <= index[:, 3] * index[:, 4] * 3)
    assert index[:, 1].tolist()[:3] == [f.stat().st_size for f in files[:3]]
    assert not any(Path(ds.cache_path).glob("pixels*"))

    (tmp_path / "prompts.jsonl").write_text(json.dumps(
        {"prompt": "<image> " * 4 + "what", "images": names, "answer": "1"}) + "\n")
    ids: list = []
    load_prompt_rows([str(tmp_path / "prompts.jsonl")], tokenizer=AutoTokenizer.from_pretrained(
        models["dense"]), prompt_ids=ids, cache_dir=str(tmp_path / "cache"), num_workers=0,
        images=image_context(str(models["dense"]), vision_spec(read_config(models["dense"]))))
    assert torch.equal(ids[0].images.pixel_values, want["pixel_values"])
    sent = pickle.dumps(ids[0])
    assert len(sent) < 2000 < want["pixel_values"].numel() * 4, len(sent)
    assert torch.equal(pickle.loads(sent).images.pixel_values, want["pixel_values"])


@pytest.mark.parametrize("row,needle", [
    ({"prompt": "<image> what", "images": ["missing.png"], "response": "1"},
     "images\\[0\\]: image file 'missing.png' not found"),
    ({"prompt": "<image> what", "images": ["http://x.org/a.png"], "response": "1"},
     "is a URL"),
    ({"prompt": "<image> <image> what", "images": ["ok.png"], "response": "1"},
     "2 image placeholder\\(s\\).*holds 1 image"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "image", "image": "ok.png"}]}]},
     "image in an assistant message"),
    ({"prompt": "<image> what", "images": [{"path": "bad.png", "bytes": None}],
      "response": "1"}, "images\\[0\\]: cannot read the image"),
    ({"prompt": "9 " * 30 + "<image> what", "images": ["ok.png"], "response": "1"},
     "cutting it would cut an image"),
])
def test_bad_image_rows_name_file_and_line(models, tmp_path, row, needle):
    from engine.data.files import DataError

    write_png(tmp_path / "ok.png", 16, 16, 0)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    rows = [{"prompt": "<image> fine", "images": ["ok.png"], "response": "1"}, row]
    with pytest.raises(DataError, match=r"rows\.jsonl:2: .*" + needle):
        _dataset(models, tmp_path, rows, seq_length=24 if "9 " in str(row) else 64)


def test_images_for_a_text_model_are_refused(models, tmp_path):
    from engine.data.files import DataError

    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]},
                          {"role": "assistant", "content": "1"}]}]
    with pytest.raises(DataError, match=r"rows\.jsonl:1: messages\[0\] has an image part but "
                                        r"the model \(model.hf_path\) has no vision tower"):
        _dataset(models, tmp_path, rows, text_model=True)


# ----------------------------------------------------------------------------- launched

@pytest.mark.parametrize("kind", ["dense", "vl3", "vl3m"])
def test_logits_equal_transformers_with_images(pools, models, kind):
    proc = pools.script(1, "tests/multirank/vlm_logits.py", str(models[kind]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = result_lines(proc.stdout)[0]
    assert r["positions_equal"] and r["diff"] < TOL * r["scale"], r
    assert r["no_images_diff"] > 1e-2 and r["positions_1d_diff"] > 1e-2, r
    assert r.get("no_deepstack_diff", 1.0) > 1e-2, r       # Qwen3-VL only


def _equal(r: dict) -> bool:
    return (r["loss_rel"] < TOL and r["grad_norm_rel"] < TOL and r["param_rel_other"] < TOL
            and r["param_rel_embedding"] < EMBEDDING_TOL)


def test_layouts_equal_one_process(pools, models, tmp_path):
    """Every layout of LAYOUTS and OVERLAP equals one process (3 steps, lr 1e-2, Adam eps
    1e-3): loss, grad norm, and every final weight but the token embedding within TOL, the
    token embedding within EMBEDDING_TOL. That bound is the measured reduction-order noise of
    the embedding, not a layout's: on the 2-core AVX-512 host (2026-11-26), Qwen3-VL-MoE at TP2+SP
    ended 1.32e-5 off in model.embed_tokens.weight (every other tensor <= 3.2e-6), and ONE
    process with nothing changed but the micro-batch size (3 instead of 16: only the order of
    the sums) 1.84e-5, at the same element ([80, 26]); the same runs in float64 agree to
    4.3e-8 (TP2+SP; limited by megatron's fp32 grad norm) and 2e-15 (micro-batches). Adam
    amplifies it there: token 80 is absent from step 1, so at step 3 that element's gradient
    (5.1e-5, 1 % of which differs between the two orders) is far below eps and its update
    moves by lr (1 - b1) / (1 - b1^3) / (sqrt(v) + eps) ~ 3 times the gradient's noise;
    the noise falls 20-30x with eps 1e-2 and the routers' top-2 margins (>= 1.8e-5) rule
    out a flipped expert. A real layout bug moves the loss by more than 1e-4 (the controls).

    The first launch also trains Qwen3-VL at one process with the overlapped gradient
    reduction on batches where one sequence has images, equal to one process without it; its
    negative control (bug=notowerpass: text-only micro-batches skip the trained tower's zero
    pass) fails as megatron's finish_grad_sync did before the fix."""
    env = {"INV_IMAGES": "1", "INV_MOE_MODEL_DIR": str(models["moe"]), "INV_ADAM_EPS": "1e-3",
           "INV_MODEL_DIRS": json.dumps({k: str(models[k]) for k in ("vl3", "vl3m")})}
    ref = tmp_path / "ref.json"
    one = f"1,1,0,1,4,m=vl3+oneimage+ov+{ONE}"
    crash = f"1,1,0,1,4,m=vl3+oneimage+ov+bug=notowerpass+{ONE}"
    first = pools.script(1, SFT, str(models["dense"]), str(ref), f"1,1,0,1,16,{ONE}",
                         f"1,1,0,1,16,moe+{ONE}", f"1,1,0,1,16,m=vl3+{ONE}",
                         f"1,1,0,1,16,m=vl3m+{ONE}", f"1,1,0,1,16,m=vl3+oneimage+{ONE}",
                         one, crash, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    results = {r["spec"]: r for r in result_lines(first.stdout)}
    assert _equal(results[one]), results[one]
    assert "Communication call has not been issued for this bucket" in results[crash]["error"]
    specs = [s + ("+" if len(s.split(",")) > 5 else ",") + ONE
             for s in LAYOUTS + OVERLAP + CONTROLS]
    proc = pools.script(2, SFT, str(models["dense"]), str(ref), *specs, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert len(results) == len(specs)
    for spec in specs[:-len(CONTROLS)]:
        assert _equal(results[spec]), results[spec]
    for spec in specs[-len(CONTROLS):]:
        assert results[spec]["loss_rel"] > 1e-4, results[spec]


@pytest.mark.parametrize("kind", ["dense", "vl3", "vl3m"])
def test_round_trip_is_bitwise_with_the_tower(pools, models, tmp_path, kind):
    model, ckpt, out = models[kind], tmp_path / "ckpt", tmp_path / "hf"
    convert_round_trip(pools, model, ckpt, out)
    a, b = _tensors(model), _tensors(out)
    assert sorted(a) == sorted(b) and any(n.startswith("model.visual.") for n in a)
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def test_sft_with_images_trains_the_tower_when_asked(pools, models, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = tmp_path / "data" / "imgs"
    images.mkdir(parents=True)
    rows = []
    for i in range(8):
        write_png(images / f"{i}.png", 12 + 4 * (i % 3), 16, i)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"imgs/{i}.png"},
                                         {"type": "text", "text": f"what is {i % 4} ?"}]},
            {"role": "assistant", "content": f"it is {i % 4}"}]})
    (tmp_path / "data" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    buf = [io.BytesIO() for _ in range(8)]
    for i, b in enumerate(buf):
        from PIL import Image
        Image.open(images / f"{i}.png").save(b, format="PNG")
    pq.write_table(pa.table({"prompt": [f"<image> sum {i}" for i in range(8)],
                             "images": [[{"bytes": b.getvalue(), "path": None}] for b in buf],
                             "response": [str(i % 4) for i in range(8)]}),
                   tmp_path / "data" / "b.parquet")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    proc = pools.script(
        1, "-m", "engine.sft", f"model.hf_path={models['dense']}",
        f"data.train_files=[{tmp_path / 'data'}]", "model.vision.freeze=false",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=48",
        "train.max_steps=3", "optim.lr=1e-2", "logging.progress_bar=false",
        f"logging.dir={tmp_path}/log", f"checkpoint.dir={ckpt}", "checkpoint.save_interval=3",
        f"data.cache_dir={tmp_path}/cache", "data.num_workers=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in open(tmp_path / "log" / "metrics.jsonl")]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    proc = pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = _tensors(models["dense"]), _tensors(out)
    tower = [n for n in a if n.startswith("model.visual.")]
    assert tower and all(not torch.equal(a[n], b[n]) for n in tower)


@pytest.mark.parametrize("extra,needle", [
    (("train.recompute=full",), "train.recompute=full is not supported with deepstack"),
    (("parallel.pp=2", "parallel.vpp=2"), "leaves 1 decoder layer\\(s\\) on the first pipeline"),
    (("model.vision.freeze=false", "model.lora.rank=4", "model.lora.alpha=8",
      "model.lora.target_modules=[q_proj]"), "the trained tower would be lost"),
])
def test_deepstack_refusals_come_before_any_process_group(models, tmp_path, extra, needle):
    proc = run_cli("engine.sft", f"model.hf_path={models['vl3']}",
                   f"data.train_files=[{tmp_path / 'none.jsonl'}]", *extra)
    assert proc.returncode != 0 and re.search(needle, proc.stderr), proc.stderr


def _prompt_images(root: Path) -> list[dict]:
    """Eight RL prompts, each an image (a PNG next to the file) and a question."""
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(8):
        write_png(root / "imgs" / f"{i}.png", 12 + 4 * (i % 3), 16, 10 + i)
        rows.append({"prompt": f"<image> what is {i} plus 1 ?", "images": [f"imgs/{i}.png"],
                     "answer": i + 1})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _transformers_gaps(model_dir: Path, root: Path, rows: list[dict], dump: Path
                       ) -> tuple[float, float]:
    """Mean |dumped rollout log-prob - transformers' own| over the sampled tokens of `dump`
    (the initial weights: step 1), with the prompts' images (transformers computes its own
    M-RoPE positions from mm_token_type_ids) and, as the control, without them."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    image = hf.config.image_token_id
    gaps = {True: [], False: []}
    for line in open(dump):
        r = json.loads(line)
        ids = torch.tensor([r["token_ids"]])
        first = r["loss_mask"].index(1)
        if int((ids[0, first:] == image).sum()):   # a sampled placeholder: transformers' own
            continue                               # forward takes none (generate feeds words)
        picture = Image.open(root / rows[r["prompt_index"]]["images"][0]).convert("RGB")
        pixels = proc(images=[picture], return_tensors="pt")
        for with_images in (True, False):
            extra = dict(pixel_values=pixels["pixel_values"],
                         image_grid_thw=pixels["image_grid_thw"],
                         mm_token_type_ids=(ids == image).int()) if with_images else {}
            hf.model.rope_deltas = None
            with torch.no_grad():
                logp = torch.log_softmax(hf(input_ids=ids, **extra).logits[0, :-1].float(), -1)
            mine = logp.gather(1, ids[0, 1:, None])[:, 0]
            gaps[with_images] += [abs(r["rollout_logprobs"][j] - float(mine[j - 1]))
                                  for j in range(1, len(r["token_ids"])) if r["loss_mask"][j]]
    assert len(gaps[True]) >= 12, gaps   # most of the 4 x 6 sampled tokens were compared
    return (sum(gaps[True]) / len(gaps[True]), sum(gaps[False]) / len(gaps[False]))


@pytest.mark.parametrize("kind", ["dense", "vl3m"])
def test_grpo_with_images_on_the_hf_backend(pools, models, tmp_path, kind):
    """GRPO, two steps, prompts with images, transformers' conditional model as the rollout
    engine (Qwen3-VL-MoE: its tower trained and synced with the text weights, its fused
    experts written through transposed views): the trainer's
    recomputed log-probs equal the engine's (rollout/logprob_diff < 1e-5) at both steps, and
    the engine's step-1 log-probs equal transformers' own forward with the images, not
    without them (control)."""
    rows = _prompt_images(tmp_path)
    proc = pools.script(
        1, "-m", "engine.rl", f"model.hf_path={models[kind]}",
        f"data.train_files=[{tmp_path / 'prompts.jsonl'}]",
        "reward.fn=tests.test_rl_loop:digit_reward", "kl.beta=0.05", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.mini_batches_per_step=1",
        "train.micro_batch_size=1", "train.max_steps=2", "train.seq_length=48", "optim.lr=1e-2",
        f"data.cache_dir={tmp_path}/cache", "data.num_workers=0", f"logging.dir={tmp_path}/run",
        f"logging.rollout_dir={tmp_path}/dump", "logging.progress_bar=false",
        *(["model.vision.freeze=false"] if kind == "vl3m" else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(metrics) == 2 and all(m["rollout/logprob_diff"] < TOL for m in metrics), metrics
    with_images, without = _transformers_gaps(models[kind], tmp_path, rows,
                                              tmp_path / "dump" / "step_1.jsonl")
    assert with_images < TOL and without > 1e-3, (with_images, without)


def test_validate_counts_the_tower_as_transformers_builds_it(models):
    """models.estimate.vision.tower_parameters equals the parameters of transformers' tower for
    the presets of the published wrappers and the tiny models; a text model has none."""
    from transformers import AutoModel

    from models.estimate.vision import tower_parameters
    from models.families.presets import MODEL_SHAPES
    from models.hf.config import hf_config_object
    from models.hf.io import read_config
    from models.families.base import original_config

    configs = [MODEL_SHAPES["qwen3-vl-8b"], MODEL_SHAPES["qwen3.5-35b-a3b-vl"]]
    configs += [read_config(models[k]) for k in ("dense", "vl3")]
    for cfg in configs:
        with torch.device("meta"):
            tower = AutoModel.from_config(hf_config_object(original_config(cfg)).vision_config)
        assert tower_parameters(cfg) == sum(p.numel() for p in tower.parameters()), cfg
    assert tower_parameters(MODEL_SHAPES["qwen3-vl-8b"]) == 576_388_336
    assert tower_parameters(MODEL_SHAPES["qwen3-8b"]) == 0


def test_experts_saved_transposed_are_refused_by_name(models, tmp_path):
    """Qwen3-VL-MoE's fused experts as transformers 5 saves them ([E, 2I, H]: the transpose of
    the published layout) would be sliced wrongly; the reader refuses them naming the layout."""
    from safetensors.torch import load_file, save_file

    from models.hf.io import SafetensorsReader, read_config
    from models.layers.biased_experts.fused import fused_expert_reader

    (tmp_path / "m").mkdir()
    for f in Path(models["vl3m"]).iterdir():
        (tmp_path / "m" / f.name).write_bytes(f.read_bytes())
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    reader = fused_expert_reader(read_config(tmp_path / "m"), SafetensorsReader(tmp_path / "m"))
    assert reader.get("model.layers.1.mlp.experts.1.up_proj.weight").shape == (16, 64)
    with pytest.raises(ValueError, match="not the published layout"):
        reader.get("model.layers.0.mlp.experts.1.up_proj.weight")
