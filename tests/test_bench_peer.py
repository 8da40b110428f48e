"""tools/bench/peer.py (the transformers peer of gpu_sft's dense case) on the CPU at tiny size,
and what `python -m tools.bench gpu` does with it: the dry run plans `peer` right after `sft`,
the report's engine/peer ratios; tools/bench/gpu/step_profile.py's summary on made-up events.

The peer's first-step loss (eager and torch.compile'd, fp32) equals a hand-written
cross-entropy of the same initial weights, and its second step equals the same step taken with
torch's unfused reference AdamW and clip_grad_norm_ (negative controls: an unshifted
cross-entropy and the initial loss differ)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tools.bench import __main__ as bench
from tools.bench import peer
from tools.bench.gpu import cli
from tools.bench.gpu.items import ORDER, build_items
from tools.bench.gpu.output import write_outputs
from tools.bench.gpu.plan import make_plan
from tools.bench.gpu.report import engine_peer_ratios, read_metrics, table
from tools.bench.gpu.step_profile import Event, profile_nth_call, summarize, union_us

SEQ, SEQS = 24, 2


@pytest.fixture(scope="module")
def tiny():
    config = peer.peer_config(tiny=True)
    return config, peer.make_batch(config.vocab_size, SEQ, SEQS, torch.device("cpu"))


def unshifted_loss(model, batch) -> float:
    """Negative control: the cross-entropy of each position's logits at its own id."""
    with torch.no_grad():
        return float(torch.stack([
            -torch.log_softmax(model(input_ids=ids).logits.float(), -1)
            .gather(-1, ids[..., None]).mean() for ids in batch]).mean())


def reference_second_loss(config, batch) -> float:
    """Step 1 with torch's unfused AdamW and clip_grad_norm_ (foreach off), then the loss."""
    model = peer.build_model(config, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=peer.LR, betas=peer.BETAS, eps=peer.EPS,
                            weight_decay=0.0, foreach=False)
    for ids in batch:
        (model(input_ids=ids, labels=ids).loss / len(batch)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), peer.CLIP, foreach=False)
    opt.step()
    return peer.reference_loss(model, batch)


def test_peer_config_is_gpu_sft_dense(tmp_path):
    from tools.bench.gpu_sft import TINY_DENSE, build_models

    path = build_models(tmp_path, True, {"dense"})["dense"]
    saved = json.loads((tmp_path / "model_dense" / "config.json").read_text())
    assert path == str(tmp_path / "model_dense")
    mine = peer.peer_config(tiny=True).to_dict()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act")
    assert {k: mine.get(k) for k in keys} == {k: saved.get(k) for k in keys}
    assert mine["hidden_size"] == TINY_DENSE["hidden"] and mine["tie_word_embeddings"]
    full = peer.peer_config(tiny=False)
    assert (full.hidden_size, full.num_hidden_layers, full.head_dim, full.vocab_size,
            full.intermediate_size) == (1024, 28, 128, 151936, 3072)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_peer_steps_match_the_reference(tiny, mode):
    config, batch = tiny
    res = peer.run_mode(mode, config, batch, steps=1, warmup=1, autocast_dtype=None,
                        profile=mode == "eager")
    init = peer.build_model(config, "cpu")
    first = peer.reference_loss(init, batch)
    assert res["losses"][0] == pytest.approx(first, rel=1e-5)
    assert abs(unshifted_loss(init, batch) - first) > 0.1  # negative control: label shift
    second = reference_second_loss(config, batch)
    assert res["losses"][1] == pytest.approx(second, rel=1e-4)
    assert abs(second - first) > 1e-3  # negative control: the step changed the weights
    assert len(res["losses"]) == 2 + (mode == "eager") and res["peak_mem_gib"] is None
    out = peer.summarize(res, config, SEQ, SEQS, warmup=1, peak_tflops=None)
    assert out["tokens_per_step"] == SEQ * SEQS and out["finite"] and out["mfu"] is None
    assert out["tokens_per_s"] == pytest.approx(SEQ * SEQS / res["step_s_all"][1])
    from tools.bench.model_flops import model_flops

    assert out["tflops"] * 1e12 * out["step_s"] == pytest.approx(
        model_flops(config.to_dict(), [SEQ] * SEQS))
    if mode == "eager":  # CPU: no device events, so no busy share; the wall is measured
        prof = res["profile"]
        assert prof["gpu_busy"] is None and prof["kernels"] == 0 and prof["wall_ms"] > 0


def test_peer_cli_writes_its_json(tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert peer.main(["--tiny", "--modes", "eager", "--seq", "16", "--gbs", "2", "--steps", "1",
                      "--warmup", "1", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eager"]["tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        peer.main(["--modes", "eager,jit"])
    assert "--modes: ['jit'] unknown; valid: eager, compiled" in capsys.readouterr().err
    item = next(i for i in build_items(["peer"], tmp_path, smoke=True))
    metrics = read_metrics(item)  # the item reads the same path the command writes
    assert metrics["modes"]["eager"]["finite"] and metrics["problems"] == []
    data = json.loads(out.read_text())
    data["args"]["modes"] = "eager,compiled"  # negative control: an asked mode left no result
    out.write_text(json.dumps(data))
    assert read_metrics(item)["problems"] == ["peer compiled: no result"]


def test_dry_run_plans_peer_right_after_sft(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "probe", lambda cuda: {"megatron", "hydra", "transformers", "peft",
                                                    "cuda"})
    assert ORDER[:2] == ("sft", "peer")
    assert bench.main(["gpu", "--dry-run", "--items", "sft,peer,mfu,grpo", "--budget-s", "540",
                       "--out", str(tmp_path / "out"), "--workdir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "   2. peer               ~150 s  at  125 s  run" in text
    assert "4 to run (~403 s), 0 skipped" in text
    cmds = [line for line in text.splitlines() if "tools.bench.peer" in line]
    assert len(cmds) == 1 and cmds[0].endswith(
        f"--modes eager,compiled --steps 5 --warmup 2 --profile --json {tmp_path / 'peer.json'}")
    assert "--profile-step 3 --json" in text and f"bench-json {tmp_path / 'mfu.json'} mfu " \
        "--profile" in text
    peer_item = build_items(["peer"], tmp_path, smoke=False)[0]
    assert peer_item.needs == ("transformers", "cuda")  # no megatron, no hydra


def sft_record(dense: float, status: str = "ok") -> dict:
    return {"item": "sft", "kind": "sft", "status": status, "estimate_s": 118, "seconds": 100,
            "note": None, "error": None,
            "metrics": {"cases": {"dense": {"step_s": 0.8, "tokens_per_s": dense, "mfu": 0.2,
                                            "peak_mem_gib": 19.0, "losses": [12.0, 3.0],
                                            "profile": {"gpu_busy": 0.712, "kernels": 16675,
                                                        "host_syncs": 3}}}}}


def test_report_ratios_and_digest(tmp_path):
    peer_rec = {"item": "peer", "kind": "peer", "status": "ok", "estimate_s": 150,
                "seconds": 140, "note": None, "error": None,
                "metrics": {"modes": {"eager": {"step_s": 1.316, "tokens_per_s": 25000.0,
                                                "mfu": 0.125, "peak_mem_gib": 20.0,
                                                "compile_s": 1.5},
                                      "compiled": {"step_s": 0.708, "tokens_per_s": 40000.0,
                                                   "mfu": 0.23, "peak_mem_gib": 19.3,
                                                   "compile_s": 80.0}}}}
    records = [sft_record(50000.0), peer_rec]
    records[0]["metrics"]["cases"]["moe"] = {"tokens_per_s": 30000.0}  # another model: no ratio
    assert engine_peer_ratios(records) == {"dense/eager": 2.0, "dense/compiled": 1.25}
    assert engine_peer_ratios([sft_record(50000.0, "failed"), peer_rec]) == {}  # negative
    text = table(records)
    assert "GPU busy 71.2% of a profiled step, 16,675 kernels, 3 host syncs" in text
    assert "compiled 0.708 s, 40,000 tok/s, MFU 23.0%, 19.3 GiB (first step 80.0 s)" in text
    assert text.endswith("Engine/peer tokens/s (sft case / peer mode, this call): "
                         "dense/eager 2.00x, dense/compiled 1.25x")
    write_outputs(tmp_path, {"environment": {"python": "3", "cpu": "x"}, "budget_s": 480},
                  make_plan([("sft", 118, None), ("peer", 150, None)], 480), records)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["ratios"]["dense/compiled"] == 1.25


def test_step_profile_summary():
    ev = [Event("cudaLaunchKernel", False, 0, 1), Event("cuLaunchKernel", False, 1, 2),
          Event("gemm", True, 10, 20), Event("rmsnorm", True, 15, 25),  # overlapping streams
          Event("Memcpy DtoH (Device -> Pageable)", True, 30, 35),
          Event("cudaStreamSynchronize", False, 29, 36),
          Event("cudaDeviceSynchronize", False, 40, 41), Event("aten::mm", False, 0, 5)]
    s = summarize(ev, wall_s=50e-6, own_syncs=1)
    assert (s["device_ms"], s["gpu_busy"]) == (0.02, 0.4)  # union 15 + 5 us of 50 us
    assert (s["kernels"], s["launch_calls"], s["d2h_copies"]) == (2, 2, 1)
    assert s["host_syncs"] == 1 and s["sync_calls"] == {"cudaStreamSynchronize": 1}
    assert summarize(ev, wall_s=50e-6)["host_syncs"] == 2  # negative control: own sync kept
    assert summarize([e for e in ev if not e.on_device], 1.0)["gpu_busy"] is None
    untraced = summarize([e for e in ev if e.on_device or e.name.startswith("aten")], 1.0)
    assert untraced["host_syncs"] is None and untraced["launch_calls"] is None  # not 0
    assert union_us([(0, 2), (1, 3), (5, 6)]) == 4 and union_us([]) == 0

    class Owner:
        def step(self, x):
            return x + 1

    saved = []
    profile_nth_call(Owner, "step", 2, saved.append)
    o = Owner()
    assert [o.step(1), o.step(2), o.step(3)] == [2, 3, 4]
    assert len(saved) == 1 and saved[0]["call"] == 2 and math.isfinite(saved[0]["wall_ms"])
