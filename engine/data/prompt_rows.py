"""RL prompt rows ``{"prompt": str | messages, "answer": str, ...}``: checked, and with a
tokenizer rendered once per input into the data cache of engine.data.cache (the counterpart of
engine.data.datasets's SFT datasets; engine.data.datasets re-exports load_prompt_rows).

Prompts may hold images (engine.data.images: content parts, or an ``images`` column with
``<image>`` placeholders) for a model with a vision tower: they are read and stored once into
the cache entry (engine.data.image_store, as SFT rows), and such a row's rendered prompt is a
models.vision.inputs.ImagePrompt whose images are a reference into the entry (the pixels are
produced where they are used: the rollout engine's prefill, the trainer's micro-batches). The
cached row keeps its image parts as ``{"type": "image"}`` and loses its ``images`` column
(the images live in the cache).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from engine.data import cache
from engine.data.files import (DataError, RowUnit, read_rows, read_unit, resolve_data_files,
                               where as where_of)
from engine.data.image_store import ImagePartWriter, StoredImages, write_image_store
from engine.data.images import (ImageContext, collect_images, expand_placeholders,
                                process_images, refuse_images)
from engine.data.render import render_prompt
from models.vision.inputs import ImagePrompt
from engine.data.rows import check_messages


def _prompt_row(path: str, line: int, row: dict) -> dict:
    """A checked prompt row (answer as a string), or DataError naming file:line."""
    loc = where_of(path, line)
    for key in ("prompt", "answer"):
        if key not in row:
            raise DataError(f"{loc}: missing field {key!r}")
    prompt, answer = row["prompt"], row["answer"]
    if isinstance(prompt, list):
        check_messages(prompt, "prompt", loc)
    elif not isinstance(prompt, str):
        raise DataError(f"{loc}: field 'prompt' must be a string or a list of messages, "
                        f"got {type(prompt).__name__}")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(f"{loc}: field 'answer' must be a string, got "
                        f"{type(answer).__name__}")
    return {**row, "answer": answer}


def _prompt_unit(k: int, unit: RowUnit, tmp: str, dtype: str,
                 tools: list | None = None, ctx: ImageContext | None = None) -> dict:
    """Worker: check and render the prompt rows of `unit` into ``part-<k>.ids`` (rendered
    prompts) and ``part-<k>.rows`` (JSON lines: location, row); `tools` (when given) replace
    the rows' own "tools" in the rendering; `ctx`: a model with a vision tower (the rows'
    images into ``part-<k>.images`` / ``.grids``; None: rows with images are refused)."""
    tokenizer = cache.worker_tokenizer()
    images = ImagePartWriter(os.path.join(tmp, f"part-{k:07d}")) if ctx else None
    lengths: list[int] = []
    error, done = None, 0
    prefix = os.path.join(tmp, f"part-{k:07d}")
    with open(prefix + ".ids", "wb") as fi, open(prefix + ".rows", "w", encoding="utf-8") as fr:
        try:
            for path, line, row in read_unit(unit):
                done += 1
                loc = where_of(path, line)
                row, loaded = _row_images(row, loc, path, ctx)
                row = _prompt_row(path, line, row)
                ids = render_prompt(row["prompt"], tokenizer, loc,
                                    tools if tools is not None else row.get("tools"))
                if images is not None:
                    processed = process_images(loaded, ctx, loc) if loaded else None
                    if processed is not None:
                        ids, _ = expand_placeholders(ids, np.zeros(len(ids), np.uint8),
                                                     processed, ctx.spec, loc)
                    images.add(processed)
                fi.write(np.asarray(ids, dtype=dtype).tobytes())
                fr.write(json.dumps([loc, row], ensure_ascii=False) + "\n")
                lengths.append(len(ids))
        except DataError as e:
            error = str(e)
    cache.tick(done)
    if images is not None:
        images.close()
    return {"lengths": np.asarray(lengths, dtype=np.int64), "error": error,
            "images": images.counts() if images is not None else None,
            "parts": (prefix + ".ids", prefix + ".rows")}


def _row_images(row: dict, where: str, path: str, ctx: ImageContext | None):
    """(`row` with its image parts as placeholders, its images: engine.data.images.
    collect_images) for a model with a vision tower; without one, `row` unchanged after
    refusing images."""
    if ctx is None:
        refuse_images(row, where)
        return row, []
    return collect_images(row, where, os.path.dirname(os.path.abspath(path)))


def _build_prompts(tmp: str, paths: list[str], tokenizer, num_workers: int | None,
                   key: dict, tools: list | None = None, ctx: ImageContext | None = None
                   ) -> None:
    dtype = cache.token_dtype(len(tokenizer))
    results = cache.run_units(cache.units_for(paths), _prompt_unit,
                              (tmp, dtype.name, tools, ctx), tokenizer, num_workers,
                              "rendering prompts")
    for r in results:
        if r["error"] is not None:
            raise DataError(r["error"])
    cache.concat_parts(tmp, [r["parts"][0] for r in results], "ids.bin")
    cache.concat_parts(tmp, [r["parts"][1] for r in results], "rows.jsonl")
    if ctx is not None:
        write_image_store(tmp, [r["parts"][0][:-len(".ids")] for r in results],
                          [r["images"] for r in results], ctx.processor)
    lengths = np.concatenate([r["lengths"] for r in results] or [np.zeros(0, np.int64)])
    np.save(os.path.join(tmp, "offsets.npy"),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    cache.write_meta(tmp, {"key": key, "dtype": dtype.name, "num_rows": int(len(lengths))})


def load_prompt_rows(files: str | Sequence[str], locations: list | None = None, *,
                     tokenizer=None, prompt_ids: list | None = None,
                     cache_dir: str | None = None, num_workers: int | None = None,
                     tools: list[dict] | None = None,
                     images: ImageContext | None = None) -> list[dict]:
    """RL prompt rows ``{"prompt": str | messages, "answer": str, ...extra fields kept}``.

    An integer answer is turned into its decimal string. Raises DataError with file:line for a
    missing or invalid prompt/answer, and naming the files when there is no row at all. When
    `locations` is a list, the "file:line" of every row is appended to it.

    With `tokenizer`, rows are checked and their prompts rendered (chat template, generation
    prompt) once per input into the data cache (see load_sft_dataset for `cache_dir` and
    `num_workers`); when `prompt_ids` is a list, every row's rendered prompt ids (a list of
    ints, as render_prompt returns) are appended to it. `tools` (JSON schemas; the RL tool
    environment's) are rendered into every prompt instead of the rows' own "tools" field.
    `images` (engine.data.images.image_context; a model with a vision tower): prompts may hold
    images, and a row with images gets an ImagePrompt in `prompt_ids` (module docstring).
    """
    if tokenizer is None:
        if prompt_ids is not None:
            raise ValueError("prompt_ids needs the tokenizer that renders them")
        rows = []
        for path, line, row in read_rows(files):
            rows.append(_prompt_row(path, line, row))
            if locations is not None:
                locations.append(where_of(path, line))
    else:
        paths = resolve_data_files(files)
        params = {} if tools is None else {"tools": tools}
        if images is not None:
            params["images"] = images.fingerprint()
        key = cache.cache_key("prompts", paths, tokenizer, params)
        entry = cache.ensure_entry(cache_dir or cache.default_cache_dir(), key,
                                   lambda tmp: _build_prompts(tmp, paths, tokenizer, num_workers,
                                                              key, tools, images))
        rows = []
        with open(os.path.join(entry, "rows.jsonl"), encoding="utf-8") as f:
            for line in f:
                loc, row = json.loads(line)
                rows.append(row)
                if locations is not None:
                    locations.append(loc)
        if prompt_ids is not None:
            ids = cache.open_array(entry, "ids.bin", np.dtype(cache.read_meta(entry)["dtype"]))
            offsets = np.load(os.path.join(entry, "offsets.npy"))
            stored = StoredImages.open(entry, images.spec) if images is not None else None
            prompt_ids.extend(_prompt(ids[offsets[i]:offsets[i + 1]].tolist(), stored, i)
                              for i in range(len(offsets) - 1))
    if not rows:
        raise DataError(f"no prompt rows in {', '.join(resolve_data_files(files))}")
    return rows


def _prompt(ids: list[int], stored: StoredImages | None, i: int) -> list[int]:
    """Row i's rendered prompt: its ids, as an ImagePrompt when the row has images (a
    reference into the cache entry; engine.data.image_store.CachedImages)."""
    if stored is None or not stored.has_images(i):
        return ids
    spec = stored.spec
    return ImagePrompt(ids, stored.image_set(i), spec.image_token_id, spec.merge_size)
