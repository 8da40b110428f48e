"""The processed images of an SFT cache entry (engine.data.cache), beside its ids.

Files of an entry with images: ``pixels.bin`` (float32, every kept row's patches one after
the other, ``pixel_dim.npy`` values each), ``grids.bin`` ([images, 3] int64),
``patch_offsets.npy`` and ``image_offsets.npy`` (per kept row: where its patches and its grids
start; one more entry than rows). Workers write one part per unit (ImagePartWriter), the
build concatenates them in unit order (write_image_store), every rank maps them
(StoredImages). A row without images has no patches and no grids.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from engine.data import cache
from engine.data.files import DataError
from models.vision.inputs import ImageSet, SequenceVision
from models.vision.spec import VisionSpec


class ImagePartWriter:
    """A worker's images part: ``<prefix>.pixels`` and ``<prefix>.grids``, and per kept row
    its patch and image counts."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._pixels = open(prefix + ".pixels", "wb")
        self._grids = open(prefix + ".grids", "wb")
        self.patches: list[int] = []
        self.images: list[int] = []
        self.dim = 0

    def add(self, row_images) -> None:
        """One kept row's engine.data.images.RowImages (None: a row without images)."""
        if row_images is None:
            self.patches.append(0)
            self.images.append(0)
            return
        self._pixels.write(row_images.pixel_values.tobytes())
        self._grids.write(row_images.grid_thw.astype(np.int64).tobytes())
        self.patches.append(int(row_images.pixel_values.shape[0]))
        self.images.append(int(row_images.grid_thw.shape[0]))
        self.dim = int(row_images.pixel_values.shape[1])

    def close(self) -> None:
        self._pixels.close()
        self._grids.close()

    def counts(self) -> dict:
        return {"patches": np.asarray(self.patches, np.int64),
                "images": np.asarray(self.images, np.int64), "dim": self.dim}


def write_image_store(tmp: str, prefixes: list[str], counts: list[dict]) -> None:
    """Concatenate the workers' parts (unit order) into the entry's image files."""
    cache.concat_parts(tmp, [p + ".pixels" for p in prefixes], "pixels.bin")
    cache.concat_parts(tmp, [p + ".grids" for p in prefixes], "grids.bin")
    dims = {c["dim"] for c in counts if c["dim"]}
    if len(dims) > 1:
        raise DataError(f"the image processor gave patches of different sizes {sorted(dims)}")
    for name, key in (("patch_offsets.npy", "patches"), ("image_offsets.npy", "images")):
        per_row = np.concatenate([c[key] for c in counts] or [np.zeros(0, np.int64)])
        np.save(os.path.join(tmp, name), np.concatenate([[0], np.cumsum(per_row)]).astype(
            np.int64))
    np.save(os.path.join(tmp, "pixel_dim.npy"), np.asarray([dims.pop() if dims else 0]))


class StoredImages:
    """The mapped image files of an entry; `sequence(i, tokens)` gives sample i's images."""

    def __init__(self, pixels, grids, patch_offsets, image_offsets, dim: int,
                 spec: VisionSpec):
        self.pixels, self.grids, self.dim, self.spec = pixels, grids, dim, spec
        self.patch_offsets, self.image_offsets = patch_offsets, image_offsets

    @staticmethod
    def open(entry: str, spec: VisionSpec) -> "StoredImages":
        dim = int(np.load(os.path.join(entry, "pixel_dim.npy"))[0])
        return StoredImages(cache.open_array(entry, "pixels.bin", np.float32),
                            cache.open_array(entry, "grids.bin", np.int64),
                            cache.open_array(entry, "patch_offsets.npy", np.int64),
                            cache.open_array(entry, "image_offsets.npy", np.int64), dim, spec)

    def has_images(self, i: int) -> bool:
        return int(self.image_offsets[i]) != int(self.image_offsets[i + 1])

    def image_set(self, i: int) -> ImageSet:
        """Sample i's images, read from the mapped files (a copy)."""
        a, b = int(self.image_offsets[i]), int(self.image_offsets[i + 1])
        p, q = int(self.patch_offsets[i]), int(self.patch_offsets[i + 1])
        pixels = torch.from_numpy(np.array(self.pixels[p * self.dim:q * self.dim])
                                  ).view(q - p, self.dim)
        grids = torch.from_numpy(np.array(self.grids[3 * a:3 * b])).view(b - a, 3)
        return ImageSet(pixels, grids)

    def sequence(self, i: int, tokens: list[int]) -> SequenceVision | None:
        """Sample i's SequenceVision (None: no image) for its input `tokens`."""
        if not self.has_images(i):
            return None
        return SequenceVision.of(tokens, self.image_set(i), self.spec.image_token_id,
                                 self.spec.merge_size)


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
