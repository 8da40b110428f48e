"""Soft overlong punishment (DAPO's, usable with every algorithm: `dapo.overlong_buffer`,
`dapo.overlong_penalty`): a reward term that falls linearly to -penalty over the last `buffer`
tokens before the response limit. Local to one process; no collective runs."""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment (DAPO eq. 13): a float32 reward term per response, shape of
    ``lengths``.

    With ``L`` the response length in tokens and ``start = max_len - buffer``: 0 for
    ``L <= start``; ``-penalty * (L - start) / buffer`` for ``start < L <= max_len`` (linear from
    0 down to ``-penalty`` at ``max_len``); ``-penalty`` for ``L > max_len``. Example with
    ``max_len=100, buffer=20``: L=80 -> 0, L=90 -> -0.5, L=95 -> -0.75, L=100 and beyond -> -1.
    ``buffer=0`` makes it a step: 0 up to ``max_len``, ``-penalty`` beyond.
    """
    if not 0 <= buffer <= max_len:
        raise ValueError(f"need 0 <= buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty}")
    lengths = lengths.to(torch.float32)
    if buffer == 0:
        return torch.where(lengths > max_len, -float(penalty), 0.0).to(torch.float32)
    start = max_len - buffer
    fraction = ((lengths - start) / buffer).clamp(0.0, 1.0)
    return -penalty * fraction
