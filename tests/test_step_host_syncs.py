"""No host syncs in the training step's forward/backward, and one in the grad norm
(tests/multirank/step_syncs_check.py counts them on the CPU: the calls that make a CUDA host
read a device value or wait for it, by caller site).

A packed micro-batch (three sequences in one row) through a tiny dense Qwen3 and a tiny
Qwen3-MoE (8 experts, top-2, grouped experts) as the engine builds them: 0 syncs in forward and
backward. The negative control restores megatron's code paths in the same process (a plain
PackedSeqParams whose boundaries the attention reads back, megatron's thd RoPE, the
masked_select permutation, the dispatcher's device-to-host copy and chunk sort): the syncs the
change removed are counted there, by name, with the same logits and gradients bitwise (fp32).
The grad norm over 49 gradient tensors: megatron's local stand-in reads each tensor's norm back
(49 + 2 syncs), the engine's one `.item()`; the clip scale has none either way and gives the
same gradients bitwise.

A whole SFT optimizer step of the MoE model (TrainEngine, 2 packed micro-batches, 2 MoE layers)
reads the device three times, each once per step whatever the micro-batch and layer counts: the
reports of all micro-batches (one stacked copy; before, one read per entry), the expert loads of
the MoE metrics (one stacked copy; before, a copy per layer per micro-batch in a router hook)
and the grad norm. Its other counted calls read host tensors (on a GPU host too): the batch's
loss weights and token counts, the metrics' CPU reductions, and torch AdamW's step counters.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import result_lines
from tools.tiny_models import build_tiny_model

CHECK = str(Path(__file__).parent / "multirank" / "step_syncs_check.py")
LAYERS = 2
# the step's device reads, each once per step (2 micro-batches x 2 MoE layers would show as more)
STEP_DEVICE_READS = {"cpu @ engine/training/schedule.py": 1,
                     "cpu @ engine/training/router_losses.py": 1,
                     "item @ megatron/core/optimizer/clip_grads.py": 1}
# calls on host tensors (host tensors on a GPU host too): batch planning before any device work
# (RouterLosses.before_step's real-token counts run on the host micro-batches, before
# run_micro_batches moves them), the metrics' gloo reductions, the reports' host copy, torch
# AdamW's CPU step counters
STEP_HOST_ONLY = {"__float__ @ engine/training/loss.py", "tolist @ engine/training/rank_batch.py",
                  "__float__ @ engine/training/router_losses.py",
                  "__int__ @ engine/training/router_losses.py",
                  "tolist @ engine/training/schedule.py", "__float__ @ engine/training/schedule.py",
                  "item @ megatron/core/optimizer/optimizer.py"}


@pytest.fixture(scope="module")
def rows(pools, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("syncs")
    small = dict(hidden=32, layers=LAYERS, heads=4, kv_heads=2, intermediate=64, tokenizer=False)
    dense = build_tiny_model(str(root / "dense"), "qwen3", **small)
    moe = build_tiny_model(str(root / "moe"), "qwen3_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, **small)
    proc = pools.script(1, CHECK, dense, moe, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result_lines(proc.stdout)


def _model(rows, model, mode) -> dict:
    (row,) = [r for r in rows if r.get("model") == model and r["mode"] == mode]
    return row


def _sites(row) -> dict[str, int]:
    """{"op @ file": count} with line numbers dropped."""
    out: dict[str, int] = {}
    for site, n in row["sites"].items():
        key = site.rsplit(":", 1)[0]
        out[key] = out.get(key, 0) + n
    return out


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_packed_forward_backward_has_no_host_sync(rows, model):
    row = _model(rows, model, "engine")
    assert row["syncs"] == 0, row["sites"]
    # the same numbers as megatron's paths, bitwise
    assert row["logits"] == 0.0 and row["grads"] == 0.0, row
    # RoPE's cos table once per micro-batch (models.layers.attention.rope_tables); megatron's
    # RoPE computes it for queries and for keys in every layer
    assert row["cos"] == 1, row
    assert _model(rows, model, "megatron")["cos"] == 2 * LAYERS


def test_negative_control_counts_the_removed_syncs(rows):
    rope = "megatron/core/models/common/embeddings/rope_utils.py"
    dense = _sites(_model(rows, "dense", "megatron"))
    # per layer: queries' and keys' RoPE read the lengths and compare the table size with a
    # device scalar; the attention reads the boundaries
    assert dense == {f"tolist @ {rope}": 2 * LAYERS, f"__bool__ @ {rope}": 2 * LAYERS,
                     "tolist @ parallel/packed_seqs.py": LAYERS}, dense
    moe = _sites(_model(rows, "moe", "megatron"))
    utils = "megatron/core/transformer/moe/moe_utils.py"
    dispatcher = "megatron/core/transformer/moe/token_dispatcher.py"
    assert moe[f"masked_select @ {utils}"] == 2 * LAYERS         # tokens and probabilities
    assert moe[f"maybe_move_tensor_to_cpu @ {dispatcher}"] == 2 * LAYERS  # counts per expert
    assert moe[f"tolist @ {utils}"] == 6 * LAYERS    # the identity chunk sort, both ways
    assert _model(rows, "moe", "megatron")["syncs"] == sum(dense.values()) + 10 * LAYERS


def test_grad_norm_reads_the_device_once(rows):
    norms = {r["mode"]: r for r in rows if r.get("case") == "grad_norm"}
    engine, megatron = norms["engine"], norms["megatron"]
    assert _sites(engine) == {"item @ megatron/core/optimizer/clip_grads.py": 1}, engine
    assert megatron["syncs"] == megatron["tensors"] + 2, megatron   # the negative control
    assert engine["norm"] == megatron["norm"]
    clips = {r["mode"]: r["syncs"] for r in rows if r.get("case") == "clip"}
    assert clips == {"engine": 0, "megatron": 0}
    (same,) = [r for r in rows if r.get("case") == "clip_equal"]
    assert same["equal"] and same["norm_equal"], same


def test_whole_step_reads_the_device_three_times(rows):
    (step,) = [r for r in rows if r.get("case") == "step"]
    assert step["micro_batches"] == 2.0 and step["loss"] > 0, step
    sites = _sites(step)
    device = {k: n for k, n in sites.items() if k not in STEP_HOST_ONLY}
    assert device == STEP_DEVICE_READS, step["sites"]
