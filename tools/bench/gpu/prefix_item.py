"""The checklist item `prefix_sharing`: `python -m tools.bench prefix_sharing` (train.prefix_sharing
on vs off on the same batches, fp32, one process; --quick for the CPU smoke) through prep
bench-json, read by tools.bench.gpu.report.read_prefix. Estimate: not measured on a GPU yet
(~60 s guessed: 9 engine builds of the 8-layer hidden-256 model, 3 passes of <= 10,000 tokens
each way); smoke 31 s measured on the 2-core CPU host (2026-11-28)."""
from __future__ import annotations

from pathlib import Path

ESTIMATES = (60, 35)   # seconds on a GPU (guessed), of the CPU smoke (measured)


def prefix_sharing_item(work: Path, smoke: bool, item, module):
    """The Item of `python -m tools.bench prefix_sharing`; `item` and `module` are
    tools.bench.gpu.items' Item and module (passed in: items imports this module)."""
    out = work / "prefix_sharing.json"
    cmd = module("tools.bench.gpu.prep", "bench-json", out, "prefix_sharing",
                 *(["--quick"] if smoke else []))
    return item("prefix_sharing", "prefix", [cmd], 300, out, work, note="fp32")
