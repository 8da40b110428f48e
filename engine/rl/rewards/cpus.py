"""How many scoring processes a rank starts by default (`reward.num_workers: null`)."""
from __future__ import annotations

import os


def default_num_workers() -> int:
    """The CPUs this process may use, at least 1: its affinity mask, shared with the other
    ranks of its node (torchrun's LOCAL_WORLD_SIZE) when the mask is more than a fair share
    of the node's CPUs (unpinned ranks see every CPU: each gets mask // local ranks); a mask
    of a fair share or less is the rank's own (a launcher that pins ranks) and is used whole."""
    mask = len(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if local > 1 and mask * local > (os.cpu_count() or mask):
        mask //= local
    return max(1, mask)
