"""Rows with images: where the images are, how they are read, processed and tokenized.

Formats (a row may use either; images are taken in the order they appear):
- chat rows (``messages`` or ShareGPT ``conversations``) whose message content is a list of
  parts in HF's format: ``{"type": "text", "text": str}`` and ``{"type": "image", "image":
  REF}`` (``"path"`` is read as ``"image"``);
- an ``images`` column (a list of REFs, TRL's and verl's form) consumed in order by
  ``<image>`` placeholders in the prompt or message strings, and by image parts without a
  REF (``{"type": "image"}``); prompt/response rows use the placeholders in ``prompt``.
A REF is a path (a relative one resolves against the folder of the data file that names it),
raw bytes, or ``{"bytes": ..., "path": ...}`` as parquet files store HF datasets' Image
feature. URLs are refused (nothing is downloaded at run time).

An image is read as transformers' ``load_image`` reads it (EXIF orientation applied, RGB) and
processed by the checkpoint folder's own image processor (its preprocessor_config.json) with
transformers' PIL backend, on every host: its pixel values then do not depend on whether
torchvision is installed (the torchvision backend resamples differently, and transformers
picks it when it is). The data cache keeps the image itself (its file's bytes, or its RGB
pixels when smaller: engine.data.image_codec) and the processor's grids; the processor's
patches are produced when a batch is built (engine.data.image_store). The chat template
renders each image as one placeholder (``<|image_pad|>`` between the vision start and end
tokens), which `expand_placeholders` repeats once per merged patch, exactly as transformers'
processor expands it in text. Placeholder tokens are never trained.

Every problem is a DataError naming the file and line (`where`): a missing or unreadable
image, a URL, placeholders that do not match the images, images for a model without a vision
tower, images in an assistant message.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.files import DataError
from engine.data.image_codec import StoredImage, load_image, run_processor
from engine.data.render import render_row_arrays
from models.vision.spec import VisionSpec

PLACEHOLDER = "<image>"          # the images column's placeholder in prompt / message strings
STORED_FORM = "encoded-or-rgb-1"  # how the cache keeps images (engine.data.image_codec)


@dataclass
class ImageContext:
    """What rendering a row with images needs: the checkpoint's image processor (PIL backend;
    None when the folder has none: rows with images are then refused) and its VisionSpec.
    Picklable: data workers get a copy."""

    processor: Any
    spec: VisionSpec
    hf_dir: str = ""

    def fingerprint(self) -> dict:
        """What the processed rows depend on (part of the data cache key): the processor's
        settings, the placeholder, the cache's image form (engine.data.image_codec) and
        Pillow, which decodes the stored files."""
        import PIL   # Pillow: only models with a vision tower need it

        return {"processor": None if self.processor is None else self.processor.to_dict(),
                "image_token_id": self.spec.image_token_id, "merge_size": self.spec.merge_size,
                "stored": STORED_FORM, "pillow": PIL.__version__}


def image_context(hf_dir: str, spec: VisionSpec | None) -> ImageContext | None:
    """The ImageContext of the checkpoint folder `hf_dir` (None for a model without a vision
    tower); its processor is None when the folder has no preprocessor_config.json."""
    if spec is None:
        return None
    from transformers import AutoImageProcessor   # only models with a vision tower need it

    if not os.path.isfile(os.path.join(hf_dir, "preprocessor_config.json")):
        return ImageContext(None, spec, hf_dir)
    return ImageContext(AutoImageProcessor.from_pretrained(hf_dir, backend="pil"), spec, hf_dir)


@dataclass
class RowImages:
    """A row's images as the cache keeps them (engine.data.image_codec: `stored`, in order)
    and their grids (grid_thw [images, 3] int64, from the processor)."""

    stored: list[StoredImage]
    grid_thw: np.ndarray


# ----------------------------------------------------------------------------- reading

def _split_placeholders(text: str) -> list[dict]:
    parts = []
    for k, piece in enumerate(text.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _message_parts(content: Any, where: str, field: str, column: bool) -> Any:
    """`content` as HF parts when it holds images (or placeholders for the images column),
    else unchanged."""
    if isinstance(content, str):
        return _split_placeholders(content) if column and PLACEHOLDER in content else content
    if not isinstance(content, list):
        return content          # engine.data.rows reports the type
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
            raise DataError(f"{where}: {field}[{j}] must be a part {{'type': 'text', 'text'}} "
                            f"or {{'type': 'image', 'image'}}")
        if part["type"] == "text":
            parts += (_split_placeholders(str(part.get("text", ""))) if column
                      else [{"type": "text", "text": part.get("text", "")}])
        else:
            ref = part.get("image", part.get("path"))
            parts.append({"type": "image"} if ref is None else {"type": "image", "image": ref})
    return parts


def _chat_key(row: dict) -> str | None:
    return next((k for k in ("messages", "conversations") if isinstance(row.get(k), list)),
                None)


def collect_images(row: dict, where: str, base_dir: str) -> tuple[dict, list]:
    """(`row` with image parts as {"type": "image"} placeholders, its images in order as
    (PIL image, engine.data.image_codec.StoredImage) pairs). A row without images comes back
    unchanged with []."""
    column = row.get("images")
    if column is not None and not isinstance(column, list):
        raise DataError(f"{where}: field 'images' must be a list of images, got "
                        f"{type(column).__name__}")
    column = list(column or [])
    row = dict(row)
    key = _chat_key(row)
    refs: list[tuple[Any, str]] = []
    if key is not None:
        text_key = "content" if key == "messages" else "value"
        turns = []
        for i, m in enumerate(row[key]):
            if isinstance(m, dict) and text_key in m:
                m = dict(m, **{text_key: _message_parts(m[text_key], where,
                                                        f"{key}[{i}].{text_key}", bool(column))})
                refs += _refs(m[text_key], f"{key}[{i}].{text_key}")
            turns.append(m)
        row[key] = turns
    elif isinstance(row.get("prompt"), (str, list)):
        row["prompt"] = _prompt_parts(row["prompt"], where, bool(column))
        for i, m in enumerate(row["prompt"] if isinstance(row["prompt"], list) else []):
            if isinstance(m, dict):
                refs += _refs(m.get("content"), f"prompt[{i}].content")
    return _resolve(row, refs, column, where, base_dir)


def _prompt_parts(prompt: Any, where: str, column: bool) -> Any:
    if isinstance(prompt, str):
        parts = _message_parts(prompt, where, "prompt", column)
        return prompt if isinstance(parts, str) else [{"role": "user", "content": parts}]
    return [dict(m, content=_message_parts(m["content"], where, f"prompt[{i}].content", column))
            if isinstance(m, dict) and "content" in m else m for i, m in enumerate(prompt)]


def _refs(parts: Any, field: str) -> list[tuple[Any, str]]:
    if not isinstance(parts, list):
        return []
    return [(p.get("image"), f"{field}[{j}]") for j, p in enumerate(parts)
            if isinstance(p, dict) and p.get("type") == "image"]


def _resolve(row: dict, refs: list, column: list, where: str, base_dir: str
             ) -> tuple[dict, list]:
    """Fill the image parts without a REF from the images column, in order; read them all."""
    missing = sum(1 for ref, _ in refs if ref is None)
    if missing != len(column):
        raise DataError(f"{where}: the row has {missing} image placeholder(s) ({PLACEHOLDER} or "
                        f"image parts without an image) but field 'images' holds "
                        f"{len(column)} image(s)")
    images, pending = [], iter(range(len(column)))
    for ref, field in refs:
        if ref is None:
            k = next(pending)
            ref, field = column[k], f"images[{k}]"
        images.append(load_image(ref, where, field, base_dir))
    _strip_refs(row)
    return row, images


def _strip_refs(row: dict) -> None:
    """Image parts become {"type": "image"} (what chat templates render as a placeholder)."""
    for key in ("messages", "conversations", "prompt"):
        turns = row.get(key)
        if not isinstance(turns, list):
            continue
        for m in turns:
            for k in ("content", "value"):
                if isinstance(m, dict) and isinstance(m.get(k), list):
                    m[k] = [{"type": "image"} if p.get("type") == "image" else p for p in m[k]]
    row.pop("images", None)


# ----------------------------------------------------------------------------- tokens

def process_images(images: list, ctx: ImageContext, where: str) -> RowImages:
    """The row's `images` ((PIL image, StoredImage) pairs from collect_images, in order) with
    their grids: the processor runs here once for the grids and to refuse what it cannot
    take; the pixels are produced again from the stored forms when a batch is built."""
    if ctx.processor is None:
        raise DataError(f"{where}: the row has images but {ctx.hf_dir} (model.hf_path) has no "
                        "preprocessor_config.json, the image processor published with the "
                        "checkpoint; copy it there")
    _, grids = run_processor(ctx.processor, [image for image, _ in images], where)
    return RowImages([stored for _, stored in images], grids)


def expand_placeholders(ids: list[int], trained: np.ndarray, images: RowImages,
                        spec: VisionSpec, where: str) -> tuple[list[int], np.ndarray]:
    """Each image's single placeholder repeated once per merged patch (untrained)."""
    at = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(at) != len(images.grid_thw):
        raise DataError(f"{where}: the chat template rendered {len(at)} image placeholder(s) "
                        f"for {len(images.grid_thw)} image(s) (token id {spec.image_token_id}); "
                        "does the text itself hold the placeholder token?")
    out_ids: list[int] = []
    out_trained: list[np.ndarray] = []
    start = 0
    for i, grid in zip(at, images.grid_thw):
        out_ids += ids[start:i]
        out_trained.append(trained[start:i])
        n = spec.tokens_per_image(grid)
        out_ids += [spec.image_token_id] * n
        out_trained.append(np.zeros(n, dtype=np.uint8))
        start = i + 1
    out_ids += ids[start:]
    out_trained.append(trained[start:])
    return out_ids, np.concatenate(out_trained).astype(np.uint8)


def refuse_images(row: dict, where: str,
                  why: str = "the model (model.hf_path) has no vision tower") -> None:
    """DataError (saying `why`) when `row` holds images."""
    if row.get("images"):
        raise DataError(f"{where}: the row has images (field 'images') but {why}")
    key = _chat_key(row)
    turns = row.get(key) if key else (row.get("prompt") if isinstance(row.get("prompt"), list)
                                      else [])
    for i, m in enumerate(turns or []):
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image"
                                             for p in content):
            raise DataError(f"{where}: {key or 'prompt'}[{i}] has an image part but {why}")


def render_with_images(row: dict, tokenizer, ctx: ImageContext | None, where: str,
                       base_dir: str) -> tuple[list[int], np.ndarray, RowImages | None]:
    """(ids, trained, images or None) of one SFT row (engine.data.render.render_row_arrays
    with the row's images read, processed and their placeholders expanded). `ctx` None: a
    text model, which refuses rows with images."""
    if ctx is None:
        refuse_images(row, where)
        ids, trained = render_row_arrays(row, tokenizer, where)
        return ids, trained, None
    row, images = collect_images(row, where, base_dir)
    ids, trained = render_row_arrays(row, tokenizer, where)
    if not images:
        if ctx.spec.image_token_id in ids:
            raise DataError(f"{where}: the row's text holds the image placeholder token (id "
                            f"{ctx.spec.image_token_id}) but the row has no image")
        return ids, trained, None
    processed = process_images(images, ctx, where)
    ids, trained = expand_placeholders(list(ids), np.asarray(trained, dtype=np.uint8),
                                       processed, ctx.spec, where)
    return ids, trained, processed
