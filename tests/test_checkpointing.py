"""Training checkpoints: atomic save protocol, torn-checkpoint fallback, keep_last, exact resume
(same and other layout), data position, RNG/optimizer round trip, export to HF.

Unit tests build fake checkpoint directories (no torch.distributed). The run tests train a tiny
Qwen3 model with the real entry point (`-m engine.sft`, gloo, 4 optimizer steps of 8 samples =
one epoch of the 32-sample dataset):
  A  DP2 over 2 "nodes" x 1 process through recipes/sft_multi_node.sh: 4 steps straight,
     a checkpoint every step, keep_last=3;
  B  DP2 (plain torchrun) stopped by train.exit_interval=2 (save on exit), then B2 resumes it;
  C  TP2 through recipes/sft_single_node.sh, resume=auto over a copy of A's checkpoints
     whose iter_0000004 and iter_0000003 are torn (falls back to iter_0000002);
  E  tools/convert.py mcore-to-hf of A's run directory, loaded in transformers.
Adam eps is 1e-4 (as in the invariance tests): with 1e-8, parameters whose gradient is ~1e-8
get updates of size ~lr that flip with reduction-order noise between layouts.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.run.run_loop import StopMonitor
from engine.checkpoint.io import (LATEST_FILE, CheckpointError, checkpoint_problems,
                                  iteration_dir, newest_complete, prune, publish, read_latest,
                                  resolve_resume, rewind_jsonl, staging_dir,
                                  write_complete_marker)
from engine.checkpoint.checkpointing import DataPosition
from models.bridge.checkpoint import (LEGACY_SOURCE_DIR, SOURCE_DIR, check_checkpoint_dir,
                                      source_dir)
from tests.launch import (REPO_ROOT, WARNING_LINE, filter_noise, free_port, result_lines,
                          run_torchrun)

STEPS, GBS, N_TRAIN = 4, 8, 32
SAME_LAYOUT_TOL, OTHER_LAYOUT_TOL = 1e-6, 1e-4


# ----------------------------------------------------------------------------- fake dirs

def fake_checkpoint(root: Path, it: int, complete: bool = True) -> Path:
    """A staged-and-published directory shaped like a checkpoint (metadata.json + shards)."""
    stage = staging_dir(root, it)
    stage.mkdir(parents=True)
    (stage / "metadata.json").write_text("{}")
    (stage / "__0_0.distcp").write_bytes(b"x" * (10 + it))
    (stage / SOURCE_DIR).mkdir()
    (stage / SOURCE_DIR / "config.json").write_text("{}")
    if not complete:
        os.replace(stage, iteration_dir(root, it))  # a directory renamed without a marker
        return iteration_dir(root, it)
    write_complete_marker(stage, it)
    return publish(root, it)


def test_publish_writes_marker_then_latest(tmp_path):
    path = fake_checkpoint(tmp_path, 10)
    assert path == tmp_path / "iter_0000010" and not staging_dir(tmp_path, 10).exists()
    assert read_latest(tmp_path) == 10
    assert (tmp_path / LATEST_FILE).read_text() == "10\n"
    marker = json.loads((path / "complete.json").read_text())
    assert marker["files"] == {"__0_0.distcp": 20, "hf_source/config.json": 2,
                               "metadata.json": 2}
    assert checkpoint_problems(path) == []


def test_damaged_checkpoint_is_detected(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    (path / "__0_0.distcp").write_bytes(b"x")
    assert checkpoint_problems(path) == [f"{path}: __0_0.distcp has 1 bytes, expected 13"]
    (path / "__0_0.distcp").unlink()
    assert checkpoint_problems(path) == [f"{path}: missing file __0_0.distcp"]
    (path / "complete.json").unlink()
    assert "no complete.json" in checkpoint_problems(path)[0]


def test_incomplete_save_is_never_published(tmp_path):
    stage = staging_dir(tmp_path, 5)
    stage.mkdir()
    with pytest.raises(CheckpointError, match="metadata.json missing"):
        write_complete_marker(stage, 5)
    with pytest.raises(CheckpointError, match="incomplete"):
        publish(tmp_path, 5)
    assert read_latest(tmp_path) is None and not iteration_dir(tmp_path, 5).exists()


def test_newest_complete_skips_torn_with_warning(tmp_path):
    for it in (1, 2):
        fake_checkpoint(tmp_path, it)
    fake_checkpoint(tmp_path, 3, complete=False)
    damaged = fake_checkpoint(tmp_path, 4)
    (damaged / "metadata.json").unlink()
    staging_dir(tmp_path, 5).mkdir()  # a save in progress: ignored
    warnings = []
    assert newest_complete(tmp_path, warnings.append) == iteration_dir(tmp_path, 2)
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith(f"skipping torn checkpoint {iteration_dir(tmp_path, 4)}")
    assert warnings[1].startswith(f"skipping torn checkpoint {iteration_dir(tmp_path, 3)}")
    assert "names iteration 4" in warnings[2]


def test_resolve_resume_modes(tmp_path):
    run = tmp_path / "run"
    assert resolve_resume("never", str(run), print) is None
    assert resolve_resume("auto", None, print) is None
    assert resolve_resume("auto", str(run), print) is None  # fresh start: nothing saved yet
    fake_checkpoint(run, 2)
    torn = fake_checkpoint(run, 4, complete=False)
    assert resolve_resume("auto", str(run), lambda m: None) == iteration_dir(run, 2)
    assert resolve_resume(str(run), None, lambda m: None) == iteration_dir(run, 2)
    assert resolve_resume(str(iteration_dir(run, 2)), None, print) == iteration_dir(run, 2)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(str(torn), None, print)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(str(tmp_path / "missing"), None, print)
    with pytest.raises(CheckpointError, match="no complete iter_NNNNNNN"):
        resolve_resume(str(tmp_path / "run" / "iter_0000002" / SOURCE_DIR), None, print)


def test_source_dir_prefers_hf_source_and_reads_old_hf(tmp_path):
    """The checkpoint's own folder: hf_source/ when there (a save_hf checkpoint's hf/ beside it
    is the export, never read), else hf/ as checkpoints written before hf_source/ hold it."""
    new = fake_checkpoint(tmp_path / "new", 1)
    (new / "hf").mkdir()   # checkpoint.save_hf's export
    (new / "hf" / "config.json").write_text('{"export": true}')
    assert (SOURCE_DIR, LEGACY_SOURCE_DIR) == ("hf_source", "hf")
    assert source_dir(new) == new / "hf_source"
    check_checkpoint_dir(new)
    old = fake_checkpoint(tmp_path / "old", 1)
    (old / SOURCE_DIR).rename(old / "hf")
    assert source_dir(old) == old / "hf"
    check_checkpoint_dir(old)   # an old checkpoint is still one of this project
    shutil.rmtree(old / "hf")   # control: neither folder
    with pytest.raises(CheckpointError, match="no hf_source/config.json"):
        check_checkpoint_dir(old)


def test_prune_keeps_newest_complete(tmp_path):
    for it in (1, 2, 3, 4, 5):
        fake_checkpoint(tmp_path, it)
    fake_checkpoint(tmp_path, 6, complete=False)   # torn newest: does not count
    staging_dir(tmp_path, 1).mkdir()               # stale staging dir of an old save
    assert prune(tmp_path, None) == []
    removed = prune(tmp_path, 2)
    assert [p.name for p in removed] == ["iter_0000001", "iter_0000001.tmp", "iter_0000002",
                                        "iter_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000004", "iter_0000005", "iter_0000006", LATEST_FILE]
    with pytest.raises(ValueError):
        prune(tmp_path, 0)


def test_rewind_jsonl_drops_steps_after_checkpoint(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3))
                   + '{"step": 4, "lo')  # torn by a crash
    assert rewind_jsonl(log, 2) == 2
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    assert rewind_jsonl(log, 2) == 0 and rewind_jsonl(tmp_path / "none.jsonl", 2) == 0


def test_stop_monitor_interval_and_signal():
    previous = signal.getsignal(signal.SIGUSR1)
    monitor = StopMonitor(exit_interval=3)
    try:
        assert [monitor.should_stop(s) for s in (1, 2)] == [None, None]
        assert monitor.should_stop(3) == "train.exit_interval=3"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert monitor.should_stop(4) == "exit signal received"
    finally:
        monitor.close()
    assert signal.getsignal(signal.SIGUSR1) is previous
    timed = StopMonitor(exit_duration_mins=1e-9)
    try:
        assert timed.should_stop(1) == "train.exit_duration_mins=1e-09"
    finally:
        timed.close()


def test_stop_monitor_sigint_stops_then_a_late_second_one_aborts(monkeypatch):
    previous = signal.getsignal(signal.SIGINT)
    monitor = StopMonitor()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C forwarded by torchrun: no abort
        assert monitor.should_stop(1) == "exit signal received"
        monkeypatch.setattr(StopMonitor, "ABORT_AFTER_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        monitor.close()
    assert signal.getsignal(signal.SIGINT) is previous


def test_data_position_mismatches():
    saved = DataPosition(6, 8, 100, 1, True)
    assert saved.consumed_samples == 48
    assert saved.mismatches(DataPosition(0, 8, 100, 1, True)) == []
    assert saved.mismatches(DataPosition(0, 16, 99, 1, True)) == [
        "train.global_batch_size: checkpoint has 8, this run has 16",
        "the training dataset size (data.train_files): checkpoint has 100, this run has 99"]


def test_checkpoint_config_problems(tmp_path):
    from engine.config.schema import SFTConfig, sft_problems

    cfg = SFTConfig()
    assert sft_problems(cfg) == []
    fake_checkpoint(tmp_path, 3)
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = str(tmp_path), \
        "never", 0
    problems = sft_problems(cfg)
    assert len(problems) == 2, problems
    assert problems[0] == "checkpoint.keep_last=0 must be null or an integer > 0"
    assert "already holds checkpoints (up to iter_0000003)" in problems[1]
    cfg.checkpoint.resume = str(tmp_path / "nope")
    assert "no such directory" in sft_problems(cfg)[-1]
    cfg = SFTConfig()
    cfg.checkpoint.schedule = "keep"
    assert sft_problems(cfg) == ["checkpoint.schedule='keep' is not valid; choose one of same, "
                                 "checkpoint, config"]


# ----------------------------------------------------------------------------- real runs

def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _script(script: str, env: dict, *args: str, timeout: int = 600):
    env = {k: str(v) for k, v in env.items()}
    proc = subprocess.run(["bash", str(REPO_ROOT / "recipes" / script), *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        print(filter_noise(proc.stdout), filter_noise(proc.stderr))
    return proc


def _multi_node(env: dict, nodes: int, *args: str, timeout: int = 600) -> list:
    """recipes/sft_multi_node.sh once per node rank, all on this host (static rendezvous)."""
    port = free_port()
    env = {k: str(v) for k, v in env.items()}
    procs = [subprocess.Popen(["bash", str(REPO_ROOT / "recipes" / "sft_multi_node.sh"), *args],
                              env={**env, "NNODES": str(nodes), "NODE_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for rank in range(nodes)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        if p.returncode:
            print(filter_noise(out), filter_noise(err))
        outs.append((p.returncode, out))
    return outs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tools.tiny_models import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("ckpt_model") / "model"), "qwen3",
                            vocab_size=200, initializer_range=0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, pools):
    """Real launches (the recipes' shell scripts, two nodes on this host; a run stopped at
    train.exit_interval and relaunched): what is checked is the run across launches. The
    first part of B (it writes the checkpoint) and the export E (tools/convert.py) run on the
    session's rank pool (tests/pool.py); every resume is a new launch."""
    from tools.demo import chat_row

    root = tmp_path_factory.mktemp("ckpt_runs")
    model = tiny_model
    pairs = [(a, b) for a in range(8) for b in range(4)]
    train = _write_jsonl(root / "train.jsonl", [chat_row(a, b) for a, b in pairs])
    evals = _write_jsonl(root / "eval.jsonl", [chat_row(a, 9) for a in range(6)])
    recipe = root / "tiny.yaml"
    recipe.write_text(f"""
model: {{dtype: float32}}
train: {{global_batch_size: {GBS}, micro_batch_size: 4, seq_length: 64, max_steps: {STEPS},
        eval_interval: 2}}
optim: {{lr: 3.0e-3, min_lr: 3.0e-4, schedule: cosine, eps: 1.0e-4}}
logging: {{progress_bar: false, sample_ids: true}}
checkpoint: {{save_interval: 1, keep_last: 3}}
""")
    env = _env(MODEL_DIR=model, TRAIN_FILES=train, EVAL_FILES=evals, NPROC_PER_NODE=1)
    out = {"root": root, "model": model, "eval": evals}
    out["A"] = _multi_node({**env, "RUN_DIR": root / "A"}, 2, str(recipe))
    base = ["-m", "engine.sft", "--config", str(recipe), f"model.hf_path={model}",
            f"data.train_files=[{train}]", f"data.eval_files=[{evals}]"]
    b = [*base, f"logging.dir={root / 'B'}", f"checkpoint.dir={root / 'B' / 'ckpt'}",
         "checkpoint.save_interval=0", "checkpoint.keep_last=null"]
    # B writes the checkpoint on the rank pool; B2, the resume, is a new launch that reads it
    out["B"] = pools.script(2, *b, "train.exit_interval=2", timeout=600)
    # with Python's default warning filters (the suite's PYTHONWARNINGS=ignore removed): the
    # resume's output is checked for library warnings (tests/launch.py WARNING_LINE)
    out["B2"] = run_torchrun(2, *b, timeout=600, env={"PYTHONWARNINGS": ""})
    # D: B's final checkpoint (4 of 4 steps) resumed with train.max_steps=8 under each
    # checkpoint.schedule (the default "same" refuses before any step)
    for name, mode in (("D_same", None), ("D_config", "config"), ("D_checkpoint", "checkpoint")):
        out[name] = pools.script(
            2, *base, f"logging.dir={root / name}", f"checkpoint.dir={root / name / 'ckpt'}",
            f"checkpoint.resume={iteration_dir(root / 'B' / 'ckpt', STEPS)}",
            f"train.max_steps={2 * STEPS}", "checkpoint.save_interval=0",
            "checkpoint.save_on_exit=false", "train.eval_interval=0",
            *([f"checkpoint.schedule={mode}"] if mode else []), timeout=600)
    c_ckpt = root / "C" / "checkpoints"  # A's checkpoints, the two newest torn
    if (root / "A" / "checkpoints").is_dir():
        shutil.copytree(root / "A" / "checkpoints", c_ckpt)
        next(iteration_dir(c_ckpt, 4).glob("*.distcp")).unlink()
        (iteration_dir(c_ckpt, 3) / "complete.json").unlink()
        staging_dir(c_ckpt, 5).mkdir()
    out["C"] = _script("sft_single_node.sh",
                       {**env, "NPROC_PER_NODE": 2, "RUN_DIR": root / "C"}, str(recipe),
                       "parallel.tp=2")
    out["E"] = pools.script(1, "tools/convert.py", "mcore-to-hf", "--ckpt",
                            str(iteration_dir(root / "A" / "checkpoints", 4)), "--out",
                            str(root / "E"), timeout=300)
    return out


def _losses(run_dir: Path) -> dict:
    return {r["step"]: r for r in _read_jsonl(run_dir / "metrics.jsonl")}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_multi_node_run_saves_every_step_and_prunes(runs):
    assert [rc for rc, _ in runs["A"]] == [0, 0]
    ckpt = runs["root"] / "A" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000002", "iter_0000003", "iter_0000004", LATEST_FILE]
    assert read_latest(ckpt) == 4
    assert all(checkpoint_problems(iteration_dir(ckpt, it)) == [] for it in (2, 3, 4))
    assert "removed" in runs["A"][0][1] and "iter_0000001" in runs["A"][0][1]
    a = _losses(runs["root"] / "A")
    assert sorted(a) == [1, 2, 3, 4] and len({round(a[s]["loss"], 4) for s in a}) == 4


def test_exit_interval_saves_and_resume_is_exact(runs):
    assert runs["B"].returncode == 0 and runs["B2"].returncode == 0
    assert "stopping after step 2: train.exit_interval=2" in runs["B"].stdout
    assert "resumed from" in runs["B2"].stdout and "2 steps done" in runs["B2"].stdout
    # a default 2-rank run (checkpoint load, training, save) prints no library warning
    # (parallel.LIBRARY_WARNINGS; the filters' negative control: tests/test_cli_help.py)
    assert WARNING_LINE.findall(runs["B2"].stdout + runs["B2"].stderr) == [], runs["B2"].stderr
    a, b = _losses(runs["root"] / "A"), _losses(runs["root"] / "B")
    assert sorted(b) == [1, 2, 3, 4]  # the log holds each step once
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert _rel(b[step][key], a[step][key]) <= SAME_LAYOUT_TOL, (step, key)
    assert _rel(b[4]["eval/loss"], a[4]["eval/loss"]) <= SAME_LAYOUT_TOL
    ckpt = runs["root"] / "B" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004"]


def _schedule_lrs(optim, total_steps: int, steps: range) -> list[float]:
    """The lr a straight run logs at each 1-based step of `steps` (the lr before the step's
    scheduler advance), from engine.training.optimizers.build_scheduler alone."""
    from types import SimpleNamespace

    from engine.training.optimizers import build_scheduler

    scheduler = build_scheduler(SimpleNamespace(param_groups=[{}]), optim, total_steps)
    lrs = {}
    for step in range(1, max(steps) + 1):
        lrs[step] = scheduler.optimizer.param_groups[0]["lr"]
        scheduler.step(increment=1)
    return [lrs[s] for s in steps]


def _tiny_optim(**overrides):
    from engine.config.optim_settings import OptimConfig

    return OptimConfig(**{"lr": 3.0e-3, "min_lr": 3.0e-4, "schedule": "cosine", **overrides})


def test_resume_schedule_modes_unit():
    """engine.checkpoint.schedule on megatron's scheduler: a 4-step schedule saved after 4
    steps against an 8-step config: the difference names train.max_steps with both values;
    `config` gives the straight 8-step run's lr at steps 5-8 (bitwise), `checkpoint` the
    decayed optim.min_lr (megatron's load_state_dict alone: the old behaviour)."""
    from types import SimpleNamespace

    from engine.checkpoint.schedule import resume_schedule, schedule_differences
    from engine.training.optimizers import build_scheduler

    old = build_scheduler(SimpleNamespace(param_groups=[{}]), _tiny_optim(), STEPS)
    old.step(increment=STEPS)
    saved = old.state_dict()
    straight = _schedule_lrs(_tiny_optim(), 2 * STEPS, range(STEPS + 1, 2 * STEPS + 1))
    assert all(lr > 3.0e-4 for lr in straight[:-1])

    def resumed(mode: str, optim) -> tuple[list[float], str | None]:
        new = build_scheduler(SimpleNamespace(param_groups=[{}]), optim, 2 * STEPS)
        note = resume_schedule(new, saved, mode)
        lrs = []
        for _ in range(STEPS):
            lrs.append(new.optimizer.param_groups[0]["lr"])
            new.step(increment=1)
        return lrs, note

    new_state = build_scheduler(SimpleNamespace(param_groups=[{}]), _tiny_optim(),
                                2 * STEPS).state_dict()
    assert schedule_differences(saved, new_state) == [
        "train.max_steps (optimizer steps the schedule spans): checkpoint 4, config 8"]
    assert schedule_differences(saved, old.state_dict()) == []   # num_steps is not compared
    lrs, note = resumed("config", _tiny_optim())
    assert lrs == straight and "rebuilt from the config at step 4" in note
    lrs, note = resumed("checkpoint", _tiny_optim())
    assert lrs == [3.0e-4] * STEPS and "checkpoint is kept" in note   # the old behaviour
    changed = build_scheduler(SimpleNamespace(param_groups=[{}]), _tiny_optim(
        lr=1e-3, warmup_steps=2, schedule="constant"), STEPS).state_dict()
    assert schedule_differences(saved, changed) == [
        "optim.lr (peak lr): checkpoint 0.003, config 0.001",
        "optim.min_lr (final lr (optim.lr when optim.schedule=constant)): checkpoint 0.0003, "
        "config 0.001",
        "optim.warmup_steps (warmup steps): checkpoint 0, config 2",
        "optim.schedule (decay style): checkpoint 'cosine', config 'constant'"]
    # a constant lr over more steps is the same schedule (DPO/KTO/RM tests resume so)
    constant = [build_scheduler(SimpleNamespace(param_groups=[{}]), _tiny_optim(
        schedule="constant"), steps).state_dict() for steps in (STEPS, 2 * STEPS)]
    assert schedule_differences(*constant) == []
    with pytest.raises(ValueError, match="checkpoint.schedule='keep' is not one of same, "
                                         "checkpoint, config"):
        resume_schedule(build_scheduler(SimpleNamespace(param_groups=[{}]), _tiny_optim(),
                                        STEPS), saved, "keep")


def test_resume_with_a_longer_schedule(runs):
    """B's checkpoint (4 of 4 steps, cosine 3e-3 -> 3e-4) resumed with train.max_steps=8:
    the default refuses before any step, naming train.max_steps with both values;
    checkpoint.schedule=config trains steps 5-8 at the straight 8-step run's lr (not the
    decayed min_lr the old code kept); checkpoint.schedule=checkpoint keeps that min_lr."""
    refused = runs["D_same"]
    assert refused.returncode == 2, refused.stderr
    assert ("train.max_steps (optimizer steps the schedule spans): checkpoint 4, config 8"
            in refused.stderr and "checkpoint.schedule=config" in refused.stderr)
    assert not (runs["root"] / "D_same" / "metrics.jsonl").exists()   # no step ran
    for name in ("D_config", "D_checkpoint"):
        assert runs[name].returncode == 0, runs[name].stderr
    config, kept = _losses(runs["root"] / "D_config"), _losses(runs["root"] / "D_checkpoint")
    steps = range(STEPS + 1, 2 * STEPS + 1)
    assert sorted(config) == sorted(kept) == list(steps)
    expected = _schedule_lrs(_tiny_optim(), 2 * STEPS, steps)
    assert [config[s]["lr"] for s in steps] == pytest.approx(expected, rel=1e-12)
    assert config[STEPS + 1]["lr"] == pytest.approx(1.65e-3, rel=1e-9)   # cosine midpoint
    assert [kept[s]["lr"] for s in steps] == pytest.approx([3.0e-4] * STEPS, rel=1e-12)
    assert "rebuilt from the config at step 4" in runs["D_config"].stdout
    assert "checkpoint is kept" in runs["D_checkpoint"].stdout


def test_data_position_no_sample_twice_or_skipped(runs):
    a = _read_jsonl(runs["root"] / "A" / "samples.jsonl")
    b = _read_jsonl(runs["root"] / "B" / "samples.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["indices"] for r in b] == [r["indices"] for r in a]
    seen = [i for r in b for i in r["indices"]]
    assert sorted(seen) == list(range(N_TRAIN))  # 4 steps x 8 = one epoch: a permutation
    assert [r["data/consumed_samples"] for r in _read_jsonl(
        runs["root"] / "B" / "metrics.jsonl")] == [8, 16, 24, 32]


def test_torn_checkpoints_skipped_and_other_layout_resume_matches(runs):
    """C (TP2) over DP2 checkpoints whose iter 4 lost a shard file and iter 3 its marker:
    both are skipped with a warning, iter 2 is loaded (resharded from DP2 to TP2), steps 3-4
    match the straight DP2 run and steps 1-2 are not run again."""
    proc = runs["C"]
    assert proc.returncode == 0
    ckpt = runs["root"] / "C" / "checkpoints"
    for it in (4, 3):
        assert f"skipping torn checkpoint {iteration_dir(ckpt, it)}: " in proc.stdout
    assert f"resumed from {iteration_dir(ckpt, 2)}: 2 steps done" in proc.stdout
    assert "RNG states not restored" in proc.stdout  # layout changed
    a, c = _losses(runs["root"] / "A"), _losses(runs["root"] / "C")
    assert sorted(c) == [3, 4]
    for step in (3, 4):
        assert _rel(c[step]["loss"], a[step]["loss"]) <= OTHER_LAYOUT_TOL
        assert _rel(c[step]["grad_norm"], a[step]["grad_norm"]) <= OTHER_LAYOUT_TOL
        assert c[step]["lr"] == pytest.approx(a[step]["lr"], rel=1e-12)
    assert _rel(c[4]["eval/loss"], a[4]["eval/loss"]) <= OTHER_LAYOUT_TOL
    # the step-3 loss differs from the step-2 loss by far more than the tolerance
    assert _rel(a[3]["loss"], a[2]["loss"]) > 100 * OTHER_LAYOUT_TOL
    assert all(checkpoint_problems(iteration_dir(ckpt, it)) == [] for it in (2, 3, 4))


def test_export_of_training_checkpoint_loads_and_matches_eval(runs):
    """E: the exported step-4 weights, in transformers, give the eval loss the engine logged at
    step 4 (token-mean over the eval set), and generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.data.datasets import load_sft_dataset

    assert runs["E"].returncode == 0
    out = runs["root"] / "E"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    samples = load_sft_dataset([runs["eval"]], tok, 64)

    def token_mean(m) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(len(samples)):
                s = samples[i]
                logits = m(torch.tensor([s.tokens])).logits[0].double()
                nll = torch.nn.functional.cross_entropy(logits, torch.tensor(s.labels),
                                                        reduction="none")
                mask = torch.tensor(s.loss_mask, dtype=torch.float64)
                total += float((nll * mask).sum())
                count += int(mask.sum())
        return total / count

    logged = _losses(runs["root"] / "A")[4]["eval/loss"]
    assert _rel(token_mean(model), logged) <= 1e-5
    assert _rel(token_mean(initial), logged) > 1e-2  # the export holds the trained weights
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 1 + 2 ?"}],
                                     add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 5 or int(gen[0, -1]) == 3


def test_optimizer_scheduler_and_rng_round_trip(pools, tmp_path, tiny_model):
    """At DP2: after a save and a load into a fresh state, every master weight and Adam moment
    (torch's fused AdamW too, and resumed unfused) is bitwise equal, the LR schedule and all RNG streams continue, the next step is identical;
    a checkpoint of another global batch size and a model-only checkpoint are refused. (The
    harness saves and loads inside one run, on the session's 2-rank pool.)"""
    proc = pools.script(2, "tests/multirank/checkpoint_state.py", tiny_model, str(tmp_path),
                        timeout=600)
    assert proc.returncode == 0
    (res,) = result_lines(proc.stdout)
    assert res["position"] == {"step": 2, "global_batch_size": 8, "num_samples": 100,
                               "seed": 7, "shuffle": True}
    assert res["opt_equal"] and res["n_opt_tensors"] > 0
    assert res["sched"][0] == res["sched"][1] and res["sched"][0]["num_steps"] == 2
    assert res["lr"][0] == res["lr"][1]
    assert res["rng"][0] == res["rng"][1]
    assert res["loss_next"][0] == res["loss_next"][1]
    assert "checkpoint has 8, this run has 16" in res["errors"]["gbs"]
    assert "model-only checkpoint" in res["errors"]["model_only"]
    # gradient-reduce / parameter-gather overlap: saved on -> resumed off, and off -> on
    (ov,) = result_lines(proc.stdout, "OVERLAP ")
    assert ov["all_params_equal"], ov
    assert [t["save_overlap"] for t in ov["trips"]] == [True, False]
    for trip in ov["trips"]:
        assert trip["loss_next"][0] == pytest.approx(trip["loss_next"][1], rel=1e-6, abs=0), trip
    # optim.fused=true (torch's fused AdamW): resumed fused, every master shard, moment and step
    # counter bitwise equal and the next two steps identical; resumed with optim.fused=false,
    # the resumed run runs foreach AdamW (its own setting) from the same state: the step after
    # the resumed update within fp32 rounding of the fused run's
    (fu,) = result_lines(proc.stdout, "FUSED ")
    assert fu["state_equal"] and fu["n_state_tensors"] > 0, fu
    assert fu["fused"] == [True, True, False], fu
    assert fu["loss_next"][0] == fu["loss_next"][1] == fu["loss_next"][2], fu
    assert fu["loss_after"][0] == fu["loss_after"][1], fu
    assert fu["loss_after"][2] == pytest.approx(fu["loss_after"][0], rel=1e-6), fu
    # optim.name=muon (megatron-core's Muon for the matrices, AdamW for the rest): every
    # momentum buffer, Adam moment and parameter bitwise equal after the resume, the next step
    # identical
    from tests.multirank.muon_check import MUON_RUNS
    if not MUON_RUNS:   # emerging-optimizers missing, or megatron-core >= 0.17
        return
    (mu,) = result_lines(proc.stdout, "MUON ")
    assert mu["state_equal"] and mu["momentum_buffers"] > 0, mu
    assert mu["loss_next"][0] == mu["loss_next"][1], mu
    assert mu["grad_norm_next"][0] == mu["grad_norm_next"][1], mu
    # the same under megatron-core's layer-wise distributed optimizer (each DP rank saves the
    # state of the parameters it owns); resumed at TP2 x DP1 (layout-invariant tp_mode), the
    # next step matches the straight run within the layout tolerance
    (lw,) = result_lines(proc.stdout, "MUONLW ")
    assert lw["state_equal"] and lw["momentum_buffers"] > 0, lw
    assert lw["loss_next"][0] == lw["loss_next"][1], lw
    assert lw["grad_norm_next"][0] == lw["grad_norm_next"][1], lw
    assert lw["relayout_next"] == pytest.approx([lw["loss_next"][0], lw["grad_norm_next"][0]],
                                                rel=1e-5), lw


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
