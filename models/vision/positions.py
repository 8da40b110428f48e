"""M-RoPE positions of one token sequence with images, as transformers computes them.

Every token gets a (temporal, height, width) position. Text tokens carry their running index
in all three. An image of grid (t, h, w) patches occupies t * h' * w' placeholder tokens
(h' = h / merge, w' = w / merge, row-major): the token at (k, i, j) gets
(start + k, start + i, start + j) where `start` is the running index at the image, and the
text after it continues at start + max(h', w') (Qwen3.5's `get_rope_index`: an image advances
the index by its larger side, not by its token count). Images have t = 1 (the processor
stacks each image `temporal_patch_size` times into one temporal patch).
"""
from __future__ import annotations

import torch


class PlaceholderMismatch(ValueError):
    """The placeholder tokens of a sequence do not match its images' grids."""


def mrope_positions(tokens, grids: torch.Tensor, image_token_id: int, merge_size: int
                    ) -> torch.Tensor:
    """Positions [3, len(tokens)] (int64) of one sequence starting at 0.

    `tokens`: the sequence's ids (list or 1-D tensor); `grids`: [n_images, 3] (t, h, w) in
    patches, in the order the images appear. Every run of placeholders must hold exactly the
    tokens of its image, in order (two images back to back are two runs); raises
    PlaceholderMismatch otherwise (engine.data.images reports it with file and line)."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    n = int(ids.numel())
    out = torch.empty(3, n, dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    pos = i = image = 0
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        if image >= len(grids):
            raise PlaceholderMismatch(f"placeholder tokens at position {i} but only "
                                      f"{len(grids)} image(s)")
        t, h, w = (int(x) for x in grids[image])
        hh, ww = h // merge_size, w // merge_size
        count = t * hh * ww
        run = is_image[i:i + count]
        if len(run) < count or not all(run):
            raise PlaceholderMismatch(
                f"image {image} (grid {t}x{h}x{w}) needs {count} placeholder tokens from "
                f"position {i}, found {sum(1 for _ in _leading(is_image, i))}")
        tt, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww),
                                    indexing="ij")
        out[0, i:i + count] = tt.reshape(-1) + pos
        out[1, i:i + count] = hi.reshape(-1) + pos
        out[2, i:i + count] = wi.reshape(-1) + pos
        pos += max(hh, ww)
        i += count
        image += 1
    if image != len(grids):
        raise PlaceholderMismatch(f"{len(grids)} image(s) but placeholder tokens for {image}")
    return out


def _leading(flags: list[bool], start: int):
    """The run of True flags from `start`."""
    for f in flags[start:]:
        if not f:
            return
        yield f
