"""`engine.sft` on a tiny Qwen3-MoE model through the command line: a `parallel.ep=2` run on 2
ranks, its step-2 checkpoint resumed on one process (ep 1: every expert and its optimizer
state resharded from 2 EP ranks) continues with the same losses; the moe.* / parallel.ep configuration errors name their keys (exit 2, before
any process group: in this process, tests.launch.run_main). The runs use the session's rank
pool (tests/pool.py); the 2-rank run and the resumed 1-process run are different processes.
One training row at DP2 with router aux and z-losses on (rank 1 runs only a dummy micro-batch)
equals the one-process run (engine.training.router_losses: a dummy contributes nothing).
MoE models of different depths train in turn in one process, and a pool case leaves no
megatron router-loss records to the next (megatron's tracker is process-wide)."""
import json
from pathlib import Path

import pytest

from tests.launch import run_cli
from tools.tiny_models import build_tiny_model

STEPS = 4


@pytest.fixture(scope="module")
def assets(demo_assets):
    out = demo_assets   # the demo model and data, and the MoE model beside them
    if not (out / "moe").exists():
        build_tiny_model(str(out / "moe"), "qwen3_moe", vocab_size=256, layers=2,
                         initializer_range=0.2)
    return out


def _args(assets, log_dir, *extra):
    return ["-m", "engine.sft", f"model.hf_path={assets / 'moe'}",
            f"data.train_files=[{assets / 'sft_train.jsonl'}]", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.seq_length=64", f"train.max_steps={STEPS}",
            "optim.lr=1e-3", "optim.schedule=constant", "optim.eps=1e-4",
            "logging.progress_bar=false", f"logging.dir={log_dir}", *extra]


def _metrics(log_dir):
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def test_ep2_run_resumes_at_ep1_with_resharded_experts(pools, assets, tmp_path):
    """engine.sft at parallel.ep=2 on 2 ranks (its equality with the single process at every
    step is tests/test_sft_invariance.py's), checkpoint at step 2; resumed on one process
    (ep 1: every expert and its Adam state gathered from 2 EP ranks), steps 3-4 repeat EP2's
    losses and grad norms. Step 4 follows step 3's Adam update, so it checks the resharded
    expert moments and master weights, not only the weights."""
    ckpt = tmp_path / "ckpt"
    proc = pools.script(2, *_args(assets, tmp_path / "ep2", "parallel.ep=2",
                                  f"checkpoint.dir={ckpt}", "checkpoint.save_interval=2"),
                        timeout=600)
    assert proc.returncode == 0
    assert "[sft] layout: world=2 dp=2 tp=1 pp=1 cp=1 ep=2" in proc.stdout
    ep2 = _metrics(tmp_path / "ep2")
    assert [r["step"] for r in ep2] == list(range(1, STEPS + 1))
    assert ep2[-1]["loss"] < ep2[0]["loss"]
    proc = pools.script(1, *_args(assets, tmp_path / "resumed",
                                  f"checkpoint.resume={ckpt}/iter_0000002"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in proc.stdout
    resumed = _metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        a = ep2[r["step"] - 1]
        assert r["loss"] == pytest.approx(a["loss"], rel=1e-5), r["step"]
        assert r["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), r["step"]
    assert abs(ep2[3]["loss"] - ep2[2]["loss"]) > 1e-3 * ep2[2]["loss"]


ROUTER_LOSSES = ("moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=0.01")
LOGGED = ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/expert_load_max_over_mean")


def _one_row_run(pools, assets, log_dir, world, undo=False, *extra, rows=1, steps=3):
    """`steps` steps on the first `rows` training rows (global batch and micro-batch size
    `rows`) with the router losses on, on `world` ranks of the pool
    (tests/multirank/dummy_micro_batch.py; `undo`: True undoes the padding / dummy fix,
    "uncompensated" hands megatron its own coefficients)."""
    data = Path(log_dir).parent / f"rows_{rows}.jsonl"
    data.write_text("".join(line + "\n" for line in
                            (assets / "sft_train.jsonl").read_text().splitlines()[:rows]))
    args = _args(assets, log_dir, f"train.global_batch_size={rows}",
                 f"train.micro_batch_size={rows}", f"train.max_steps={steps}",
                 f"data.train_files=[{data}]", *ROUTER_LOSSES, *extra)
    codes = pools.run(world, "tests.multirank.dummy_micro_batch:sft", args[2:], undo,
                      timeout=600)
    assert codes == [0] * world
    return _metrics(log_dir)


def test_padding_contributes_nothing_to_router_losses(pools, assets, tmp_path):
    """Two rows of 20 and 19 tokens in one micro-batch, padded to [2, 20] (one padding
    position), repeat the same rows packed without padding ([1, 39]) with router aux and
    z-losses on: loss, grad norm and moe/* at both steps (rel 1e-5): the routers get the
    padding mask (engine.training.schedule.moe_padding_mask) and the step's token count and
    loads skip padding (engine.training.router_losses). Negative control: without the mask the
    pad position's z-loss gradient reaches the pad token's all-zero embedding row through
    RMSNorm (grad norm 3057.6 instead of 10.8 at step 1 with the z-loss alone)."""
    padded = _one_row_run(pools, assets, tmp_path / "padded", 1, False, rows=2, steps=2)
    packed = _one_row_run(pools, assets, tmp_path / "packed", 1, False, "train.packing=true",
                          rows=2, steps=2)
    assert [r["step"] for r in padded] == [1, 2]
    for a, b in zip(packed, padded):
        for key in LOGGED:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    undone = _one_row_run(pools, assets, tmp_path / "undone", 1, True, rows=2, steps=1)
    assert undone[0]["grad_norm"] > 100 * padded[0]["grad_norm"]


def test_dummy_micro_batch_contributes_nothing_to_router_losses(pools, assets, tmp_path):
    """One row at DP2 x EP2, TP2+SP, DP2 x TP2+SP and CP2 (at DP2 rank 1 gets no row: it runs
    one dummy micro-batch) with moe.aux_loss_coeff and moe.z_loss_coeff > 0 repeats the
    one-process run's loss, grad norm and moe/* metrics at every step (rel 1e-5, the MoE
    layouts' tolerance in tests/test_sft_invariance.py): a dummy contributes nothing, and the
    router losses' gradient under TP+SP and CP is the one-process one
    (engine.training.router_losses `coefficients`). Negative controls: with the dummy unmarked
    (the fix undone) its router losses reach the pad token's all-zero embedding row through
    RMSNorm (grad norm ~1e7 at step 1) and the moe/* metrics count it; with the coefficients
    megatron-core expects (not compensated for TP x CP) TP2+SP's grad norm is off (megatron
    0.16.1: the z-loss gradient halved, 12.491 against 12.527; 0.19.2: the aux-loss gradient
    doubled, 12.539)."""
    one = _one_row_run(pools, assets, tmp_path / "one", 1)
    assert one[2]["loss"] < one[0]["loss"] - 1.0
    tp = ("parallel.tp=2", "parallel.sequence_parallel=true")
    # the dummy's routers decide together over TP (_all_padding: each rank holds a slice)
    for name, world, extra in (("ep2", 2, ("parallel.ep=2",)), ("tp2", 2, tp),
                               ("dp2_tp2", 4, tp), ("cp2", 2, ("parallel.cp=2",))):
        run = _one_row_run(pools, assets, tmp_path / name, world, False, *extra)
        assert [r["step"] for r in run] == [1, 2, 3]
        for a, b in zip(one, run):
            for key in LOGGED:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["step"], key)
    undone = _one_row_run(pools, assets, tmp_path / "undone", 2, True, "parallel.ep=2")
    assert undone[0]["grad_norm"] > 100 * one[0]["grad_norm"]
    assert abs(undone[0]["moe/aux_loss"] - one[0]["moe/aux_loss"]) > 0.1 * one[0]["moe/aux_loss"]
    plain = _one_row_run(pools, assets, tmp_path / "plain", 2, "uncompensated", *tp, steps=1)
    # 50 x the layouts' tolerance (measured: rel 2.9e-3 on megatron 0.16.1, 9.4e-4 on 0.19.2)
    assert abs(plain[0]["grad_norm"] - one[0]["grad_norm"]) > 5e-4 * one[0]["grad_norm"]


def test_moe_models_of_different_depths_train_in_turn_in_one_process(pools, assets, tmp_path):
    """One process trains a 5-layer MoE model between two runs of the 2-layer one, router
    losses on (megatron-core sizes its process-wide router-loss tracker by the first model that
    records, deeper than any other MoE model of the suite here:
    engine.training.router_losses `_resize_tracker`). The deep run steps and logs its own
    moe/*, and the second 2-layer run repeats the first exactly: loss, grad norm and moe/* at
    both steps. Before the change the deep run raised IndexError at its first router call past
    layer 2 (index 2 of size 2)."""
    deep = tmp_path / "moe5"
    build_tiny_model(str(deep), "qwen3_moe", vocab_size=256, layers=5, initializer_range=0.2)
    runs = [(assets / "moe", "a"), (deep, "deep"), (assets / "moe", "c")]
    argvs = []
    for model, name in runs:
        args = _args(assets, tmp_path / name, "train.max_steps=2", *ROUTER_LOSSES)
        args[2] = f"model.hf_path={model}"
        argvs.append(args[2:])
    [codes] = pools.run(1, "tests.multirank.sft_in_turn:sft_in_turn", argvs, timeout=600)
    assert codes == [0, 0, 0]
    first, deep_run, again = (_metrics(tmp_path / name) for _, name in runs)
    assert [r["step"] for r in again] == [r["step"] for r in deep_run] == [1, 2]
    for a, b in zip(first, again):
        for key in LOGGED:
            assert b[key] == a[key], (a["step"], key)
    assert all(r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 for r in first + deep_run)
    assert abs(deep_run[0]["moe/z_loss"] - first[0]["moe/z_loss"]) > 1e-3


def test_a_pool_case_leaves_no_router_loss_records_to_the_next(pools, assets, tmp_path):
    """A case that trains with router losses leaves megatron's process-wide records in its rank
    (control: read in the same case); the next case on that rank starts without them
    (tests/pool.py `_forget_megatron_groups`: on megatron-core 0.17 on the dict it used to
    clear was a copy, so records and the process groups they hold outlived their case)."""
    args = _args(assets, tmp_path / "run", "train.max_steps=1", *ROUTER_LOSSES)[2:]
    [(pid, codes)] = pools.run(1, "tests.multirank.sft_in_turn:sft_in_turn_then_names", [args],
                               timeout=600)
    assert codes[0] == [0] and codes[1] == ["load_balancing_loss", "z_loss"], codes
    [(next_pid, names)] = pools.run(1, "tests.multirank.sft_in_turn:tracker_names")
    assert next_pid == pid and names == []


def _refused(args: list[str]):
    """`python -m engine.sft ARGS` for a configuration error: main(argv) in this process."""
    assert args[:2] == ["-m", "engine.sft"]
    return run_cli("engine.sft", *args[2:])


@pytest.mark.parametrize("extra,needles", [
    (["parallel.ep=3"], ["parallel.ep=3", "dp x cp"]),
    (["parallel.ep=2", "moe.token_dispatcher=allgather"], ["moe.token_dispatcher=allgather",
                                                             "parallel.ep=1"]),
    (["moe.aux_loss_type=bogus"], ["moe.aux_loss_type='bogus'", "seq_aux_loss"]),
])
def test_moe_config_errors_name_the_key(assets, tmp_path, extra, needles):
    proc = _refused(_args(assets, tmp_path, *extra))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-2000:])


def test_ep_on_a_dense_model_is_refused(assets, tmp_path):
    args = _args(assets, tmp_path, "parallel.ep=2")
    args[2] = f"model.hf_path={assets / 'model'}"
    proc = _refused(args)
    assert proc.returncode == 2
    assert "parallel.ep=2 needs a mixture-of-experts model" in proc.stderr
