"""An image as the data cache stores it, and its pixels as the checkpoint's processor gives them.

The cache keeps each image in the smaller of two forms, both of which give back the very PIL
image transformers' ``load_image`` gives (EXIF orientation applied, RGB), so the processor's
``pixel_values`` are bitwise those of transformers' processor on the same file:
- ENCODED: the bytes of the file (or of the row's ``bytes``) as written, decoded again with
  Pillow through ``load_image`` (decoding the same bytes with the same Pillow is
  deterministic; Pillow's version is part of the cache key, engine.data.images);
- RAW: the decoded image's RGB pixels, height x width x 3 uint8 (when the file is larger than
  that: an uncompressed or noisy image), rebuilt with ``Image.frombytes``.
Either way an image costs at most its uint8 pixels in the cache; the processor runs when a
batch is built (engine.data.image_store.CachedImages), not when the cache is.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.files import DataError


@dataclass
class StoredImage:
    """One image's cache form: `data` is the file's bytes (`raw` False) or its RGB pixels after
    load_image (`raw` True, height x width x 3 uint8)."""

    data: bytes
    raw: bool
    width: int
    height: int

    @staticmethod
    def of(image, encoded: bytes) -> "StoredImage":
        """The smaller form of `image` (load_image's RGB PIL image decoded from `encoded`)."""
        width, height = image.size
        if len(encoded) <= width * height * 3:
            return StoredImage(bytes(encoded), False, width, height)
        return StoredImage(image.tobytes(), True, width, height)

    def decode(self):
        """The PIL image load_image gave when the cache was built."""
        if self.raw:
            return _pillow().frombytes("RGB", (self.width, self.height), self.data)
        return _load(io.BytesIO(self.data))


def _pillow():
    """PIL.Image, imported at first use."""
    from PIL import Image   # Pillow: only rows with images need it
    return Image


def _load(file):
    from transformers.image_utils import load_image as hf_load_image  # rows with images only

    return hf_load_image(_pillow().open(file))


def load_image(ref: Any, where: str, field: str, base_dir: str):
    """(the PIL image of one REF as transformers' load_image reads it, its StoredImage). A REF
    is a path (relative: to `base_dir`), bytes, or {"bytes", "path"}; URLs are refused."""
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    try:
        if isinstance(ref, (bytes, bytearray)):
            encoded = bytes(ref)
        elif not isinstance(ref, str) or not ref:
            raise DataError(f"{where}: {field} must be a path, bytes or {{'bytes', 'path'}}, "
                            f"got {type(ref).__name__}")
        elif ref.startswith(("http://", "https://")):
            raise DataError(f"{where}: {field} is a URL ({ref}); nothing is downloaded at run "
                            "time: store the image next to the data or as bytes")
        else:
            path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
            if not os.path.isfile(path):
                raise DataError(f"{where}: {field}: image file {ref!r} not found (looked at "
                                f"{path})")
            with open(path, "rb") as f:
                encoded = f.read()
        image = _load(io.BytesIO(encoded))
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL's many decode errors: a problem of this row
        raise DataError(f"{where}: {field}: cannot read the image ({type(e).__name__}: {e})"
                        ) from e
    return image, StoredImage.of(image, encoded)


def run_processor(processor, images: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [patches, dim] float32, grid_thw [images, 3] int64) of the PIL `images`
    (in order, in one call, as transformers' processor takes a row's images)."""
    try:
        out = processor(images=images, return_tensors="np")
    except Exception as e:  # noqa: BLE001 - e.g. an image smaller than the processor accepts
        raise DataError(f"{where}: the image processor refused the row's images "
                        f"({type(e).__name__}: {e})") from e
    return (np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
            np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3))
