"""The `packed` GPU item's logic on the CPU (tools/bench/gpu_packed.py): chat rows of seeded
log-normal lengths, rendered to exactly those lengths, packed by the engine's own token budget
and trained by its compiled step (`-m engine.sft` on the session's rank pool, train.compile=
true, tiny model, 3 steps), then the same micro-batches in the transformers peer's
padding-free path (eager); the report's fields, and the packed tokens of every step equal to
the sum of that step's drawn lengths (negative control: another draw does not match)."""
from __future__ import annotations

import json

import pytest
import torch

from tools.bench import gpu_packed
from tools.bench.gpu.items import ITEMS, ORDER, build_items
from tools.bench.gpu.report import key_numbers, read_metrics

SMOKE = ["--tiny", "--rows-per-step", "4", "--steps", "2", "--warmup", "1", "--median", "24",
         "--sigma", "0.6", "--min-len", "12", "--max-len", "80", "--budget", "128",
         "--peer-modes", "eager", "--compile", "true"]


def test_lengths_are_seeded_log_normal_and_clipped():
    a = gpu_packed.sample_lengths(400, 700, 0.9, 64, 4096, seed=0)
    assert a == gpu_packed.sample_lengths(400, 700, 0.9, 64, 4096, seed=0)
    assert a != gpu_packed.sample_lengths(400, 700, 0.9, 64, 4096, seed=1)   # control
    assert min(a) == 64 and max(a) == 4096 and len(set(a)) > 200   # both clips hit, varied
    assert sorted(a)[200] == pytest.approx(700, rel=0.2)   # the median (400 draws)


def test_peer_batch_is_padding_free():
    gen = torch.Generator().manual_seed(0)
    ids, pos, labels = gpu_packed.peer_batch([3, 2, 4], 200, torch.device("cpu"), gen)
    assert ids.shape == pos.shape == labels.shape == (1, 9)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert [i for i, v in enumerate(labels[0].tolist()) if v == -100] == [0, 3, 5]


@pytest.fixture(scope="module")
def report(pools, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("packed")
    args = gpu_packed.parse([*SMOKE, "--workdir", str(work)])

    def launch(argv, log):
        run = pools.script(1, *argv, timeout=600, check=False)
        log.write_text(run.stdout + run.stderr)
        return run.returncode

    return gpu_packed.measure(args, launch)


def test_packed_smoke_report(report):
    lengths, engine = report["lengths"], report["engine"]
    assert len(lengths) == 12 and all(12 <= n <= 80 for n in lengths)
    assert engine["steps"] == 3 and engine["sequences"] == [4, 4, 4]
    # every step's packed tokens are its rows' drawn lengths, nothing cut, nothing padded
    assert engine["tokens_match"] is True
    assert engine["num_tokens"] == [sum(lengths[k * 4:(k + 1) * 4]) for k in range(3)]
    assert sum(engine["num_tokens"]) == sum(lengths)
    assert engine["timed_tokens"] == sum(lengths[4:])
    # negative control: the same metrics against another draw do not match
    other = gpu_packed.sample_lengths(12, 24, 0.6, 12, 80, seed=1)
    assert gpu_packed.tokens_match(engine["num_tokens"], lengths, 4)
    assert not gpu_packed.tokens_match(engine["num_tokens"], other, 4)
    assert not gpu_packed.tokens_match(engine["num_tokens"], lengths[1:] + lengths[:1], 4)
    # the compiled step's counts (train.compile=true), the numbers, the CPU's missing MFU
    assert set(engine["compile"]) == set(gpu_packed.COMPILE_KEYS)
    assert all(len(v) == 3 for v in engine["compile"].values())
    assert engine["compile"]["compile/graphs"][0] > 0
    assert engine["graphs_grew_after_warmup"] in (True, False)
    assert engine["tokens_per_s"] > 0 and engine["tflops"] > 0 and engine["step_s"] > 0
    assert engine["mfu"] is None and engine["peak_mem_gib"] is None and engine["finite"]
    # the peer: the engine's micro-batches, padding-free, the same tokens
    peer = report["peer"]["eager"]
    assert peer["timed_tokens"] == engine["timed_tokens"] and peer["finite"]
    assert peer["tokens_per_s"] > 0 and report["engine_over_peer_eager"] > 0
    assert "padding-free" in report["peer_path"]
    assert all(m >= 1 for m in report["micro_batches"])
    for k in range(3):
        mbs = gpu_packed.peer_micro_batches(lengths[k * 4:(k + 1) * 4], 128)
        assert sorted(n for mb in mbs for n in mb) == sorted(lengths[k * 4:(k + 1) * 4])
        assert all(sum(mb) <= 128 for mb in mbs)


def test_packed_report_reads_and_digests(report, tmp_path):
    (item,) = build_items(["packed"], tmp_path, smoke=True)
    item.result.write_text(json.dumps(report))   # what --json writes
    metrics = read_metrics(item)
    assert metrics["problems"] == [] and metrics["packed_engine"]["tokens_match"] is True
    assert metrics["packed_engine"]["compile"]["graphs"] > 0
    line = key_numbers({"metrics": metrics})
    assert line.startswith("lengths mean ") and " tok/s, MFU n/a" in line
    assert "peer eager " in line and "graphs " in line
    report["engine"]["tokens_match"] = False   # control: a mismatch is a problem
    item.result.write_text(json.dumps(report))
    assert read_metrics(item)["problems"] == ["packed: packed tokens != drawn lengths"]


def test_packed_item_is_listed_and_built(tmp_path):
    """Listed by `bench --help` from ITEMS (tests/test_bench_gpu.py checks the listing)."""
    assert "packed" in ITEMS and "packed" not in ORDER   # named only (--items packed)
    (gpu,) = build_items(["packed"], tmp_path, smoke=False)
    (smoke,) = build_items(["packed"], tmp_path, smoke=True)
    assert gpu.kind == smoke.kind == "packed" and gpu.needs[-1] == "cuda"
    assert "tools.bench.gpu_packed" in gpu.commands[-1]
    assert "--tiny" in smoke.commands[-1] and "--tiny" not in gpu.commands[-1]
    assert gpu.estimate_s > 0 and smoke.estimate_s > 0
