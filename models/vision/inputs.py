"""The processed images of one sequence (`ImageSet`) and of one micro-batch (`VisionBatch`), a
sequence's image positions (`SequenceVision`) and a rollout prompt with images (`ImagePrompt`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from models.vision.positions import mrope_positions


class ImageSource(Protocol):
    """Images kept elsewhere (engine.data.image_store.CachedImages: a data cache entry and a
    row): picklable as a reference, and able to give the images' grids and pixels in any
    process that can read what it refers to."""

    def grid_thw(self) -> torch.Tensor: ...

    def pixel_values(self) -> torch.Tensor: ...


class ImageSet:
    """One sequence's images as the checkpoint's image processor gives them.

    pixel_values: [patches, channels * temporal_patch * patch * patch] float32, the images'
        patches one after the other (transformers' `pixel_values`);
    grid_thw: [images, 3] int64, each image's (t, h, w) in patches (`image_grid_thw`).

    Held (`ImageSet(pixel_values, grid_thw)`) or stored (`ImageSet.stored(source)`, an
    ImageSource): a stored set reads its grids and produces its pixels (the image processor
    runs) on first use, in the process that uses them, and keeps them; it pickles as its
    source, never as pixels, so sets sent between ranks carry a reference only.
    """

    def __init__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        self._pixels, self._grids, self.source = pixel_values, grid_thw, None

    @staticmethod
    def stored(source: ImageSource) -> "ImageSet":
        images = ImageSet(None, None)
        images.source = source
        return images

    @property
    def pixel_values(self) -> torch.Tensor:
        if self._pixels is None:
            self._pixels = self.source.pixel_values()
        return self._pixels

    @property
    def grid_thw(self) -> torch.Tensor:
        if self._grids is None:
            self._grids = self.source.grid_thw()
        return self._grids

    def unloaded(self) -> "ImageSet":
        """A stored set's copy without pixels (grids kept); a held set itself."""
        if self.source is None:
            return self
        copy = ImageSet.stored(self.source)
        copy._grids = self._grids
        return copy

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    def __reduce__(self):
        if self.source is not None:
            return (ImageSet.stored, (self.source,))
        return (ImageSet, (self._pixels, self._grids))

    @staticmethod
    def cat(sets: list["ImageSet"]) -> "ImageSet | None":
        sets = [s for s in sets if s is not None and len(s)]
        if not sets:
            return None
        return ImageSet(torch.cat([s.pixel_values for s in sets]),
                        torch.cat([s.grid_thw for s in sets]))


@dataclass
class VisionBatch:
    """What a micro-batch adds for a model with a vision tower (models.vision.model).

    images: the images of the micro-batch's sequences in token order (None: no image, or a
        rank off the first pipeline stage, whose pixels are never produced:
        engine.training.vision_batch), run through the tower on the first pipeline stage;
    feature_rows: [b, s_local] int64 like `tokens` (CP-sharded the same way): for a
        placeholder token, the row of the tower's output [image tokens, hidden] it takes;
        -1 elsewhere;
    positions: [3, b, S] int64 M-RoPE positions of the WHOLE micro-batch before CP sharding
        (S = s_local x cp; a packed row restarts them at every sequence): megatron's rotary
        code picks each CP rank's chunks from the full table, as it does for 1-D RoPE.
    """

    images: ImageSet | None
    feature_rows: torch.Tensor
    positions: torch.Tensor

    def to(self, device) -> "VisionBatch":
        images = None if self.images is None else ImageSet(
            self.images.pixel_values.to(device), self.images.grid_thw.to(device))
        return VisionBatch(images, self.feature_rows.to(device), self.positions.to(device))


@dataclass
class SequenceVision:
    """One training sequence's images and what its tokens need of them.

    images: the sequence's images (ImageSet);
    positions: [3, L] int64 M-RoPE positions of its L tokens from 0 (models.vision.positions);
    rows: [L] int64, for each placeholder token the row of the sequence's image features it
        takes (0, 1, ... in order), -1 elsewhere.
    """

    images: ImageSet
    positions: torch.Tensor
    rows: torch.Tensor

    @staticmethod
    def of(tokens, images: ImageSet, image_token_id: int, merge_size: int) -> "SequenceVision":
        """For `tokens` (the model's input ids) whose placeholders match `images`; raises
        models.vision.positions.PlaceholderMismatch otherwise."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        placeholder = ids == image_token_id
        rows = torch.full_like(ids, -1)
        rows[placeholder] = torch.arange(int(placeholder.sum()))
        return SequenceVision(images, mrope_positions(ids, images.grid_thw, image_token_id,
                                                      merge_size), rows)


class ImagePrompt(list):
    """A rollout prompt with images: the prompt's token ids (each image's placeholder
    expanded, engine.data.images) as a plain list, so everything that handles prompts as id
    lists (lengths, concatenation, dumps) works unchanged, plus the images and what their
    tokens need (models.vision.spec). Rollout engines that take images read `images` and
    `positions()`; the others refuse it (RolloutEngine.supports_images).

    The images are an ImageSet, stored in the data cache for prompts read from files
    (engine.data.prompt_rows): the prompt pickles with that reference, never with pixels (the
    rollout split and the rollout batch go to every rank), and never holds pixels itself, as
    it lives for the whole run: `images` gives a fresh unloaded set each time, whose pixels
    the caller produces once and keeps as long as it needs them."""

    def __init__(self, ids, images: ImageSet, image_token_id: int, merge_size: int):
        super().__init__(int(t) for t in ids)
        self._images, self.image_token_id, self.merge_size = images, image_token_id, merge_size

    @property
    def images(self) -> ImageSet:
        return self._images.unloaded()

    def vision(self, tokens, images: ImageSet | None = None) -> SequenceVision:
        """The SequenceVision of a training sequence starting with this prompt (`tokens`:
        prompt + response ids fed to the model), on `images` (default: `self.images`; pass one
        set to the sequences of a group so that its pixels are produced once). Response tokens
        are text whatever their id: a sampled placeholder token was fed to the rollout engine
        as a word (no image there), so it gets its word embedding and the next text position,
        as in the engine."""
        images = self.images if images is None else images
        prompt = SequenceVision.of(list(self), images, self.image_token_id, self.merge_size)
        extra = len(tokens) - len(self)
        after = prompt.positions[:, -1:] + torch.arange(1, extra + 1)
        return SequenceVision(images, torch.cat([prompt.positions, after], dim=1),
                              torch.cat([prompt.rows, torch.full((extra,), -1)]))

    def positions(self) -> torch.Tensor:
        """[3, len(self)] M-RoPE positions of the prompt's tokens."""
        return SequenceVision.of(list(self), self._images, self.image_token_id,
                                 self.merge_size).positions

    def __reduce__(self):   # the images' reference (or a held set's pixels), ids, tokens
        return (ImagePrompt, (list(self), self._images.unloaded(), self.image_token_id,
                              self.merge_size))
