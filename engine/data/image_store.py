"""The images of a data cache entry (engine.data.cache), beside its ids, and the reference
that produces a row's pixels where they are needed.

Files of an entry with images: ``images.bin`` (every kept row's images one after the other,
each as engine.data.image_codec stores it: the file's bytes, or its RGB pixels when smaller),
``image_index.npy`` ([images, 5] int64: byte offset, byte length, raw (1: RGB pixels), width,
height), ``grids.bin`` ([images, 3] int64, the processor's grids), ``image_offsets.npy`` (per
kept row: where its images start; one more entry than rows) and ``processor/`` (the image
processor's preprocessor_config.json). Workers write one part per unit (ImagePartWriter), the
build concatenates them in unit order (write_image_store), every rank maps them
(StoredImages). A row without images has no images.

A row's images travel as `CachedImages(entry, row)` (a models.vision.inputs.ImageSource: two
fields when pickled): `pixel_values()` decodes the row's stored images and runs the entry's
processor on them, in the process that needs the pixels (the trainer building a micro-batch,
a rollout engine's prefill). Every node holds the entry under the same path (each builds it
from the same key, data.cache_dir); a process maps an entry once.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from engine.data import cache
from engine.data.image_codec import StoredImage, run_processor
from engine.data.files import DataError
from models.vision.inputs import ImageSet, SequenceVision
from models.vision.spec import VisionSpec

PROCESSOR_DIR = "processor"


class ImagePartWriter:
    """A worker's images part: ``<prefix>.images`` and ``<prefix>.grids``, per kept row its
    image count and per image its byte length, raw flag, width and height."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._data = open(prefix + ".images", "wb")
        self._grids = open(prefix + ".grids", "wb")
        self.images: list[int] = []
        self.stored: list[tuple[int, int, int, int]] = []

    def add(self, row_images) -> None:
        """One kept row's engine.data.images.RowImages (None: a row without images)."""
        if row_images is None:
            self.images.append(0)
            return
        for image in row_images.stored:
            self._data.write(image.data)
            self.stored.append((len(image.data), int(image.raw), image.width, image.height))
        self._grids.write(row_images.grid_thw.astype(np.int64).tobytes())
        self.images.append(int(row_images.grid_thw.shape[0]))

    def close(self) -> None:
        self._data.close()
        self._grids.close()

    def counts(self) -> dict:
        return {"images": np.asarray(self.images, np.int64),
                "stored": np.asarray(self.stored, np.int64).reshape(-1, 4)}


def write_image_store(tmp: str, prefixes: list[str], counts: list[dict], processor) -> None:
    """Concatenate the workers' parts (unit order) into the entry's image files; save
    `processor` (None: the checkpoint has none, so no row has images)."""
    cache.concat_parts(tmp, [p + ".images" for p in prefixes], "images.bin")
    cache.concat_parts(tmp, [p + ".grids" for p in prefixes], "grids.bin")
    stored = np.concatenate([c["stored"] for c in counts] or [np.zeros((0, 4), np.int64)])
    starts = np.concatenate([[0], np.cumsum(stored[:, 0])])[:-1]
    np.save(os.path.join(tmp, "image_index.npy"),
            np.column_stack([starts, stored]).astype(np.int64).reshape(-1, 5))
    per_row = np.concatenate([c["images"] for c in counts] or [np.zeros(0, np.int64)])
    np.save(os.path.join(tmp, "image_offsets.npy"),
            np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64))
    if processor is not None:
        processor.save_pretrained(os.path.join(tmp, PROCESSOR_DIR))


class StoredImages:
    """The image rows of an entry; `image_set(i)` is sample i's images, stored (CachedImages)."""

    def __init__(self, entry: str, spec: VisionSpec):
        self.entry, self.spec = os.path.abspath(entry), spec
        self.image_offsets = cache.open_array(entry, "image_offsets.npy", np.int64)

    @staticmethod
    def open(entry: str, spec: VisionSpec) -> "StoredImages":
        return StoredImages(entry, spec)

    def has_images(self, i: int) -> bool:
        return int(self.image_offsets[i]) != int(self.image_offsets[i + 1])

    def image_set(self, i: int) -> ImageSet:
        """Sample i's images: a reference; the pixels are produced on first use."""
        return ImageSet.stored(CachedImages(self.entry, i))

    def sequence(self, i: int, tokens: list[int]) -> SequenceVision | None:
        """Sample i's SequenceVision (None: no image) for its input `tokens`."""
        if not self.has_images(i):
            return None
        return SequenceVision.of(tokens, self.image_set(i), self.spec.image_token_id,
                                 self.spec.merge_size)


class _MappedEntry:
    """One process's view of an entry's image files and processor (read on first use)."""

    def __init__(self, entry: str):
        if not os.path.isfile(os.path.join(entry, "image_index.npy")):
            raise DataError(f"the data cache entry {entry} holds no images on this host: every "
                            "rank loads the data (data.cache_dir) before images are used")
        self.entry = entry
        self.data = cache.open_array(entry, "images.bin", np.uint8)
        self.index = cache.open_array(entry, "image_index.npy", np.int64)
        self.grids = cache.open_array(entry, "grids.bin", np.int64)
        self.rows = cache.open_array(entry, "image_offsets.npy", np.int64)
        self._processor = None

    def processor(self):
        if self._processor is None:
            from transformers import AutoImageProcessor   # only rows with images need it

            self._processor = AutoImageProcessor.from_pretrained(
                os.path.join(self.entry, PROCESSOR_DIR), backend="pil")
        return self._processor

    def image(self, k: int) -> StoredImage:
        start, length, raw, width, height = (int(x) for x in self.index[k])
        return StoredImage(self.data[start:start + length].tobytes(), bool(raw), width, height)


_MAPPED: dict[str, _MappedEntry] = {}   # entry path -> its files, mapped once per process


def _mapped(entry: str) -> _MappedEntry:
    if entry not in _MAPPED:
        _MAPPED[entry] = _MappedEntry(entry)
    return _MAPPED[entry]


class CachedImages:
    """Row `row`'s images in the data cache entry `entry` (module docstring)."""

    __slots__ = ("entry", "row")

    def __init__(self, entry: str, row: int):
        self.entry, self.row = entry, int(row)

    def __reduce__(self):
        return (CachedImages, (self.entry, self.row))

    def __repr__(self) -> str:
        return f"CachedImages({self.entry!r}, {self.row})"

    def _span(self, mapped: _MappedEntry) -> tuple[int, int]:
        return int(mapped.rows[self.row]), int(mapped.rows[self.row + 1])

    def grid_thw(self) -> torch.Tensor:
        """[images, 3] int64, the processor's grids (read from the entry)."""
        mapped = _mapped(self.entry)
        a, b = self._span(mapped)
        return torch.from_numpy(np.array(mapped.grids[3 * a:3 * b])).view(b - a, 3)

    def pixel_values(self) -> torch.Tensor:
        """[patches, dim] float32: the entry's processor on the row's images decoded, all in
        one call (as the build ran it, and transformers' processor on the same files)."""
        mapped = _mapped(self.entry)
        a, b = self._span(mapped)
        where = f"data cache entry {self.entry}, row {self.row}"
        pixels, grids = run_processor(mapped.processor(),
                                      [mapped.image(k).decode() for k in range(a, b)], where)
        if not np.array_equal(grids.reshape(-1), mapped.grids[3 * a:3 * b]):
            raise DataError(f"{where}: the processor's grids {grids.tolist()} differ from the "
                            "cached ones; delete the cache entry")
        return torch.from_numpy(pixels)


def check_image_tokens(ids: list[int], max_ids: int, row_images, ctx, where: str) -> None:
    """DataError when a row cut to `max_ids` ids would lose some of its images' tokens, among
    its inputs (an image is all its placeholders or nothing; the last id is never an input)."""
    if row_images is None:
        return
    token = ctx.spec.image_token_id
    kept = min(max_ids, len(ids))
    if sum(1 for t in ids[:kept - 1] if t == token) == sum(1 for t in ids if t == token):
        return
    if kept < len(ids):
        raise DataError(f"{where}: the row has {len(ids)} tokens, more than train.seq_length "
                        f"+ 1 = {max_ids}, and cutting it would cut an image's tokens; raise "
                        "train.seq_length or shorten the row")
    raise DataError(f"{where}: the row ends with an image (its last token is an image "
                    "placeholder, never a model input); add text after it")
