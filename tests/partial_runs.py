"""Shared by tests/test_rl_partial_runs.py (hf) and tests/test_rl_partial_vllm.py (vLLM): the
real `python -m engine.rl` partial-rollout runs (rollout.partial=true, 4 steps, 2 groups of 4
replies, rounds of 4 tokens up to 16, an EOS-prone tiny qwen3 so reply lengths spread), how
they are compared, and the checkpoint edit of the resume's negative control."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engine.checkpoint.io import COMPLETE_MARKER, write_complete_marker

STEPS = 4
# metrics that measure time or speed: not expected to repeat
TIMING = ("time/", "rollout/tokens_per_s", "weight_sync/gbps", "perf/", "throughput/")
COMPARED = ("policy/loss", "grad_norm", "reward/mean", "rollout/logprob_diff",
            "rollout/version_span_mean", "rollout/partial_share", "rollout/engine_fill",
            "policy/kl", "policy/entropy")
# what an engine restart changes besides the run: the generate calls and their outcomes
RESTART_COUNTERS = ("rollout/restarts", "rollout/retries", "rollout/generate_calls")

Run = tuple[list[dict], list[list[dict]]]   # (metrics per step, dump records per step)


def prompts_file(root: Path) -> Path:
    """32 arithmetic prompts (answer = the row number) as a jsonl data file under `root`."""
    data = root / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                        "answer": i}) + "\n" for i in range(32)))
    return data


def launch(pools, ranks: int, model: str, data: Path, log: Path, *args: str,
           env: dict | None = None, own_world: bool = False) -> tuple[Run, object]:
    """One run on `ranks` ranks of the session's rank pool, logging to `log` (metrics.jsonl,
    rollouts/step_N.jsonl); `args` are added to (and may override) the common settings;
    `own_world`: the run starts its own process groups (a disaggregated split, Pools.script).
    Returns ((metrics per step, dump records per step), the pool's PoolRun)."""
    proc = pools.script(
        ranks, "-m", "engine.rl", f"model.hf_path={model}", f"data.train_files=[{data}]",
        "rollout.partial=true", "rollout.partial_max_new_tokens=4",
        "rollout.max_new_tokens=16", "rollout.n=4", "train.prompts_per_step=2",
        "train.mini_batches_per_step=1", "train.micro_batch_size=2",
        f"train.max_steps={STEPS}", "train.seq_length=64", "optim.lr=1e-3",
        "kl.beta=0.05", "reward.fn=tests.test_rl_loop:digit_reward", "data.shuffle=false",
        f"logging.dir={log}", f"logging.rollout_dir={log / 'rollouts'}",
        "logging.progress_bar=false", *args, env=env, timeout=600, own_world=own_world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    dumps = [[json.loads(x) for x in (log / "rollouts" / f"step_{s}.jsonl").read_text()
              .splitlines()] for s in range(1, STEPS + 1) if s <= len(metrics)]
    return (metrics, dumps), proc


def keep_versions(ckpt: Path) -> list[str]:
    """The arguments that save every version's weights as the trainer exports them
    (checkpoint.save_hf's iter_NNNNNNN/hf/ under `ckpt`)."""
    return [f"checkpoint.dir={ckpt}", "checkpoint.save_interval=1", "checkpoint.save_hf=true"]


def version_folders(model: str, ckpt: Path) -> list[str]:
    """Each version's HF folder of a run launched with keep_versions(ckpt): version 0 is
    model.hf_path."""
    return [model] + [str(ckpt / f"iter_{v:07d}" / "hf") for v in range(1, STEPS)]


def untimed(m: dict, skip: tuple[str, ...] = ()) -> dict:
    """A step's metrics without the timing ones (and without the keys starting with `skip`)."""
    return {k: v for k, v in m.items() if not k.startswith(TIMING + skip)}


def tokens(dumps: list[list[dict]]) -> list[list[list[int]]]:
    return [[r["token_ids"] for r in s] for s in dumps]


def check_resume(runs: dict, straight: str, skip: tuple[str, ...] = ()) -> None:
    """stop_and_resume's runs in `runs` against runs[straight]: the stopped run carried
    something, steps 3 and 4 of the resumed run equal the straight run's (untimed metrics
    without the keys starting with `skip`, token ids), and the run resumed without the
    carried replies (negative control) has other token ids there."""
    half, _ = runs["half"]
    resumed, dumps = runs["resumed"]
    ref, ref_dumps = runs[straight]
    assert len(half) == 2 and len(resumed) == len(runs["dropped"][0]) == STEPS
    assert half[-1]["rollout/partial_carried"] + half[-1]["rollout/partial_waiting_groups"] > 0
    assert [untimed(m, skip) for m in resumed[2:]] == [untimed(m, skip) for m in ref[2:]]
    assert tokens(dumps[2:]) == tokens(ref_dumps[2:])
    assert tokens(runs["dropped"][1][2:]) != tokens(ref_dumps[2:])


def layout_differences(ref: Run, got: Run) -> list:
    """What keeps `got` from equalling `ref` as a layout must: the dumps' token ids
    ("token_ids") and, per step, each COMPARED metric beyond rel 1e-5 (step, key, a, b)."""
    out: list = [] if tokens(ref[1]) == tokens(got[1]) else ["token_ids"]
    for step, (mr, mg) in enumerate(zip(ref[0], got[0]), 1):
        for key in COMPARED:
            a, b = mr[key], mg[key]
            if abs(a - b) > 1e-5 * max(abs(a), abs(b)) + 1e-6:
                out.append((step, key, a, b))
    return out


class TokenLogprobs:
    """log_softmax log-probs of a sequence's tokens under a version's HF weights (fp32, the
    models loaded once): `(version, ids)` -> tensor [len(ids) - 1], entry t - 1 for token t."""

    def __init__(self, folders: list[str]) -> None:
        self.folders, self.models = folders, {}

    def __call__(self, version: int, ids: list[int]) -> torch.Tensor:
        from transformers import AutoModelForCausalLM
        if version not in self.models:
            self.models[version] = AutoModelForCausalLM.from_pretrained(
                self.folders[version], dtype=torch.float32).eval()
        with torch.no_grad():
            logits = self.models[version](input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1).gather(
            -1, torch.tensor(ids[1:])[:, None])[:, 0]


def drop_carried_replies(ckpt: Path, step: int) -> None:
    """The resume's negative control: checkpoint `ckpt`/iter_<step> keeps its position and group
    counter but loses the carried replies and the waiting groups (extra.partial groups and
    ready emptied, as a resume that forgot them would); complete.json rewritten for the new
    file sizes."""
    folder = ckpt / f"iter_{step:07d}"
    common = torch.load(folder / "common.pt", map_location="cpu", weights_only=False)
    partial = common["extra"]["partial"]
    assert partial["groups"] or partial["ready"], "nothing carried: the control would not bite"
    partial["groups"], partial["ready"] = [], []
    torch.save(common, folder / "common.pt")
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    write_complete_marker(folder, step, {k: v for k, v in marker.items()
                                         if k not in ("iteration", "time", "files")})


LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}   # 2-rank runs


def partial_runs(pools, root: Path, model: str, common: list[str],
                 half_args: tuple[str, ...] = (), half_env: dict | None = None,
                 layouts: tuple[str, ...] = tuple(LAYOUTS), again: bool = True) -> dict:
    """{name: Run} of `model`, the arguments `common` added to each: "one" (keeping every
    version's weights, "versions": their folders), "again" (its repeat; not launched when
    `again` is False: the caller repeats "one" with "half" and "resumed", as
    test_rl_partial_vllm does), each of `layouts` (names of LAYOUTS: 2-rank runs; all three
    by default),
    "half" (stopped after step 2 with `half_args` and the environment `half_env`; its PoolRun
    in "half_proc"), "resumed" (half continued from its checkpoint in the same folders to step
    4) and "dropped" (the negative control: half continued from a copy of its checkpoint
    without the carried replies and the waiting groups, drop_carried_replies)."""
    data = prompts_file(root)
    out = {"versions": version_folders(model, root / "ckpt")}
    for name, ranks, layout in (("one", 1, keep_versions(root / "ckpt")),
                                *((("again", 1, []),) if again else ()),
                                *((n, 2, LAYOUTS[n]) for n in layouts)):
        out[name], _ = launch(pools, ranks, model, data, root / name, *common, *layout)
    out.update(stop_and_resume(pools, 1, root, model, data, common, half_args, half_env))
    return out


def stop_and_resume(pools, ranks: int, root: Path, model: str, data: Path, common,
                    half_args: tuple[str, ...] = (), half_env: dict | None = None,
                    own_world: bool = False) -> dict:
    """{"half": the run stopped after step 2 (checkpoint in root/ckpt_half; `half_args` and
    `half_env` for it alone), "half_proc": its PoolRun, "resumed": half continued to step 4
    in the same folders, "dropped": half continued from a copy of its checkpoint without the
    carried replies and the waiting groups (drop_carried_replies)}; `ranks` and `own_world`
    as `launch`."""
    out: dict = {}
    half = f"checkpoint.dir={root / 'ckpt_half'}"
    out["half"], out["half_proc"] = launch(pools, ranks, model, data, root / "half", *common,
                                           half, "train.exit_interval=2", *half_args,
                                           env=half_env, own_world=own_world)
    shutil.copytree(root / "ckpt_half", root / "ckpt_dropped")
    shutil.copytree(root / "half", root / "dropped")
    drop_carried_replies(root / "ckpt_dropped", 2)
    out["resumed"], _ = launch(pools, ranks, model, data, root / "half", *common, half,
                               own_world=own_world)
    out["dropped"], _ = launch(pools, ranks, model, data, root / "dropped", *common,
                               f"checkpoint.dir={root / 'ckpt_dropped'}", own_world=own_world)
    return out
