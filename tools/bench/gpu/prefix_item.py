"""The checklist item `prefix_sharing`: `python -m tools.bench prefix_sharing` (train.prefix_sharing
on vs off on the same batches, fp32, one process; --quick for the CPU smoke) through prep
bench-json, read by tools.bench.gpu.report.read_prefix. On the GPU the shared mode's tree rows
run FlexAttention (parallel.tree_attention_flex: the dispatch is by device, fp32 and head dims
16-256 qualify, as both bench models' 32 and 16); the summary's `attention` says which path
ran per workload and read_prefix calls a shared workload on CUDA that did not run flex a
problem. Estimate: not measured on a GPU yet (~120 s guessed: 8 engine builds of the 8-layer
hidden-256 model, 5 runs (a warm-up and 4 timed repeats) of 3 passes of <= 10,000 tokens each
way, plus FlexAttention's compile of its forward and backward, done once (dynamic shapes) in
the bench's warm-up run); smoke 39-47 s measured on the 2-core CPU host under load 9.5-11
(docs/benchmarks.md, "Repeated timing")."""
from __future__ import annotations

from pathlib import Path

ESTIMATES = (120, 45)   # seconds on a GPU (guessed), of the CPU smoke (measured)


def prefix_sharing_item(work: Path, smoke: bool, item, module):
    """The Item of `python -m tools.bench prefix_sharing`; `item` and `module` are
    tools.bench.gpu.items' Item and module (passed in: items imports this module)."""
    out = work / "prefix_sharing.json"
    cmd = module("tools.bench.gpu.prep", "bench-json", out, "prefix_sharing",
                 *(["--quick"] if smoke else []))
    return item("prefix_sharing", "prefix", [cmd], 420, out, work,
                note="fp32, tree attention: FlexAttention")
