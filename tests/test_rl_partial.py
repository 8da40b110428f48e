"""Partial rollouts (rollout.partial, engine.rl.collect.partial), in this process on the hf
backend: the per-row step offset (a cut-and-continued reply equals the uninterrupted one), the
collector at fixed weights against the collector without partial rollouts, carried log-probs
against the weights of the version that sampled them, the checkpoint state, the checks.
The real runs (determinism, layouts) are in tests/test_rl_partial_runs.py."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from engine.config.schema import ConfigError, load_config
from engine.generation import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import validate_rl
from engine.rl.collect.collector import RolloutCollector
from engine.rl.collect.fill import fill_counts
from engine.rl.collect.partial import PartialCollector
from engine.rl.collect.partial_checks import partial_model_problems, partial_problems
from engine.rl.config import RLConfig
from engine.rl.rewards import load_reward_fn
from models.families.base import ORIGINAL
from tools.bench.partial import eos_prone_model

ROWS = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i)}
        for i in range(24)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny qwen3 whose end-of-sequence logit is scaled up: reply lengths spread from 1 to
    max_new_tokens, so groups complete at different rounds."""
    return eos_prone_model(str(tmp_path_factory.mktemp("partial") / "qwen3"), eos_scale=2.5)


def _config(argv: list[str]) -> RLConfig:
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


# rollout.partial_driver=true: PartialCollector runs driver sessions here (RoundsCollector the
# rounds, the default path)
BASE = ["rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=16",
        "data.shuffle=false", "train.seq_length=64", "rollout.partial_max_new_tokens=4",
        "rollout.partial_driver=true"]


def _collector(cls, engine, model_dir, tmp_path, argv=()):
    from transformers import AutoTokenizer
    cfg = _config(BASE + [f"logging.rollout_dir={tmp_path}"] + list(argv))
    return cls(engine, ROWS, AutoTokenizer.from_pretrained(model_dir), load_reward_fn("math"),
               cfg)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_continued_reply_equals_uninterrupted(model_dir):
    """Cut after k tokens, continued from prompt + those tokens with first_steps=k: the same
    tokens and log-probs; without the offset (negative control) other tokens."""
    engine = HFRolloutEngine(model_dir, dtype=torch.float32)
    prompt = [5, 17, 33, 60, 9]
    params = SamplingParams(max_new_tokens=24, seeds=[11, 12])
    full = HFRolloutEngine.generate(engine, [prompt, prompt], params)
    whole = [g for g in full if len(g.response_ids) >= 12]
    assert whole, [len(g.response_ids) for g in full]
    g = whole[0]
    seed = params.seeds[full.index(g)]
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=24, seeds=[seed],
                                                   row_max_new_tokens=[5]))[0]
    assert cut.response_ids == g.response_ids[:5] and cut.finish_reason == "length"
    rest = engine.generate([prompt + cut.response_ids], SamplingParams(
        max_new_tokens=24, seeds=[seed], first_steps=[5],
        row_max_new_tokens=[len(g.response_ids) - 5]))[0]
    assert cut.response_ids + rest.response_ids == g.response_ids
    assert cut.response_logprobs + rest.response_logprobs == pytest.approx(
        g.response_logprobs, abs=1e-5)
    control = engine.generate([prompt + cut.response_ids], SamplingParams(
        max_new_tokens=len(g.response_ids) - 5, seeds=[seed]))[0]
    assert control.response_ids != g.response_ids[5:]


class NoOffsetDriver:
    """The negative control: a step driver whose continued rows restart their randomness at
    step 0 (first_steps dropped)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add(self, key, prompt, params, stream=False):
        self.inner.add(key, prompt, dataclasses.replace(params, first_steps=None), stream)


class NoOffsetCollector(PartialCollector):
    def step_driver(self):
        return NoOffsetDriver(super().step_driver())


class RoundsCollector(PartialCollector):
    """The rounds path (what pools without a step driver run: several engines, sglang)."""

    use_driver = False


def _replies(records: list[dict]) -> dict:
    return {(r["gen_batch"], r["prompt_index"], r["sample_index"]):
            (r["token_ids"], r["rollout_logprobs"]) for r in records}


def test_fixed_weights_partial_replies_equal_the_plain_run(model_dir, tmp_path):
    """lr = 0 (weights never change): every reply a partial run trains, cut and carried across
    steps or not, is token for token and log-prob for log-prob the reply of the run without
    partial rollouts (same prompts, same seeds); with the offset dropped they differ."""
    engine = HFRolloutEngine(model_dir, dtype=torch.float32)
    plain = _collector(RolloutCollector, engine, model_dir, tmp_path / "plain")
    reference, fills = {}, []

    def reference_through(runs: list[dict]) -> None:
        """The plain run's replies (`reference`) through the newest generation batch `runs`
        trained: the driver session admits groups as slots free, so 6 partial steps may
        train groups of later generation batches than 6 (up to 6, measured)."""
        newest = max(gen_batch for run in runs for gen_batch, *_ in run)
        while len(fills) <= newest:   # plain step s is generation batch s - 1
            fills.append(plain.collect(dump_step=len(fills) + 1).metrics["rollout/engine_fill"])
            reference.update(_replies(_records(tmp_path / "plain" / f"step_{len(fills)}.jsonl")))

    def partial_run(cls, where) -> tuple[dict, list[dict]]:
        c = _collector(cls, engine, model_dir, tmp_path / where)
        metrics = [c.collect(dump_step=s).metrics for s in range(1, 7)]
        out = {}
        for s in range(1, 7):
            records = _records(tmp_path / where / f"step_{s}.jsonl")
            assert all(len(r["token_versions"]) == len(r["token_ids"]) for r in records)
            out.update(_replies(records))
        return out, metrics

    got, metrics = partial_run(PartialCollector, "partial")
    control, _ = partial_run(NoOffsetCollector, "control")
    rounds, rounds_metrics = partial_run(RoundsCollector, "rounds")   # the rounds path too
    reference_through([got, control, rounds])
    assert all(0 < f <= 1 for f in fills) and min(fills) < 1   # the plain rollout's fill too
    assert len(got) == 6 * 2 * 2 and set(got) <= set(reference)
    for key, (ids, logprobs) in got.items():
        assert ids == reference[key][0], key
        assert logprobs == pytest.approx(reference[key][1], abs=1e-5)
    # replies were really cut and carried over steps: some span two versions
    assert max(m["rollout/version_span_max"] for m in metrics) >= 1
    assert sum(m["rollout/partial_share"] for m in metrics) > 0
    assert all(0 < m["rollout/engine_fill"] <= 1 for m in metrics)
    differ = [k for k in control if k in reference and control[k][0] != reference[k][0]]
    assert differ
    assert len(rounds) == 6 * 2 * 2
    assert all(ids == reference[k][0] for k, (ids, _) in rounds.items())
    assert max(m["rollout/version_span_max"] for m in rounds_metrics) >= 1


def test_carried_logprobs_are_those_of_the_sampling_version(model_dir, tmp_path):
    """Weights change between steps (version 0 -> 1 -> 2): each token's recorded log-prob is
    log_softmax of the logits under the weights of the version its token_versions entry names
    (kept here); under the newest weights (negative control) the older tokens disagree."""
    engine = HFRolloutEngine(model_dir, dtype=torch.float32)
    c = _collector(PartialCollector, engine, model_dir, tmp_path)
    versions = [{k: v.clone() for k, v in engine.model.state_dict().items()}]
    spanning = []
    for step in range(1, 4):
        c.collect(dump_step=step)
        spanning += [r for r in _records(tmp_path / f"step_{step}.jsonl")
                     if len(set(v for v in r["token_versions"] if v >= 0)) > 1]
        gen = torch.Generator().manual_seed(step)
        update = [(n, p + 0.05 * torch.randn(p.shape, generator=gen))
                  for n, p in engine.model.named_parameters() if p.dim() == 2]
        engine.update_weights(update)
        versions.append({k: v.clone() for k, v in engine.model.state_dict().items()})
    assert spanning, "no carried reply spans versions"

    def logprobs_under(state, ids):
        engine.model.load_state_dict(state)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    for r in spanning:
        ids, tv, lp = r["token_ids"], r["token_versions"], r["rollout_logprobs"]
        recomputed = {v: logprobs_under(versions[v], ids) for v in set(tv) if v >= 0}
        for t in range(1, len(ids)):
            if tv[t] >= 0:
                assert abs(recomputed[tv[t]][t - 1] - lp[t]) < 1e-4, (t, tv[t])
        newest = logprobs_under(versions[-1], ids)
        old = [t for t in range(1, len(ids)) if 0 <= tv[t] < len(versions) - 1]
        assert max(abs(newest[t - 1] - lp[t]) for t in old) > 1e-3


def test_checkpoint_state_continues_the_same_run(model_dir, tmp_path):
    """state() through JSON into a fresh collector (a resume): the following batches equal the
    straight run's."""
    engine = HFRolloutEngine(model_dir, dtype=torch.float32)
    straight = _collector(PartialCollector, engine, model_dir, tmp_path / "a")
    batches = [straight.collect(dump_step=s) for s in range(1, 4)]
    first = _collector(PartialCollector, engine, model_dir, tmp_path / "b")
    first.collect(dump_step=1)
    resumed = _collector(PartialCollector, engine, model_dir, tmp_path / "b")
    resumed.restore(json.loads(json.dumps(first.state())))
    resumed.next_gen_batch = first.next_gen_batch
    assert resumed.state()["groups"], "nothing carried: the test would not test a resume"
    for s, want in zip((2, 3), batches[1:]):
        got = resumed.collect(dump_step=s)
        assert (got.response_ids, got.rollout_logprobs, got.advantages) == (
            want.response_ids, want.rollout_logprobs, want.advantages)


def test_fill_counts_follow_the_engine_split():
    # one engine: rows of 4, 1, 1 tokens decode 4 steps, 6 of 12 slots busy
    assert fill_counts([3, 3, 3], [4, 1, 1], 1, 4, 1) == (6, 12)
    # two engines take rows 0, 2 and 1, 3 (split_groups): each call's own longest row counts
    assert fill_counts([3, 3, 3, 3], [4, 1, 4, 1], 1, 4, 2) == (10, 10)
    assert fill_counts([3, 3, 3, 3], [4, 1, 4, 1], 1, 4, 1) == (10, 16)


def test_partial_keys_are_checked_and_refused_by_name(tmp_path):
    from tools.tiny_models import build_tiny_model
    model = build_tiny_model(str(tmp_path / "m"), "qwen3", hidden=32, layers=1, heads=4,
                             kv_heads=2, seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 ?", "answer": 2}) + "\n")
    base = [f"model.hf_path={model}", f"data.train_files=[{data}]", "rollout.partial=true"]
    assert validate_rl(_config(base), 1)
    cases = {"rollout.partial_oversample=0.5": "rollout.partial_oversample=0.5 must be >= 1",
             "rollout.partial_max_new_tokens=300": "rollout.partial_max_new_tokens=300 must be "
                                                   "an integer in [1, rollout.max_new_tokens=256]",
             "rollout.partial_max_staleness=-1": "rollout.partial_max_staleness=-1 must be an "
                                                 "integer >= 0",
             "rollout.backend=sglang": "rollout.partial=true with rollout.backend='sglang' is "
                                       "not built",
             "env.fn=tools": "rollout.partial=true with env.fn='tools' is not built",
             "reward.judge.base_url=http://127.0.0.1:1/v1": "rollout.partial=true with "
                                                           "reward.judge.base_url is not built"}
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_rl(_config(base + [override]), 1)
    # vllm is built (a continued reply: a fresh seeded draw), its keys checked as usual
    assert partial_problems(_config(base + ["rollout.backend=vllm"])) == []
    # both placements are built (tests/test_rl_partial_async.py runs the disaggregated one)
    dis = base + ["rollout.placement=disaggregated", "rollout.max_staleness=1"]
    assert partial_problems(_config(dis)) == []
    (problem,) = partial_problems(_config(dis + ["rollout.check_behaviour_logprobs=true"]))
    assert problem.startswith("rollout.partial=true with rollout.check_behaviour_logprobs=true "
                              "is not built")
    # the driver path is a choice of partial rollouts: alone it is refused by name
    assert partial_problems(_config(base + ["rollout.partial_driver=true"])) == []
    assert partial_problems(_config(base[:-1] + ["rollout.partial_driver=true"])) == [
        "rollout.partial_driver=true needs rollout.partial=true"]
    # a conditional-generation checkpoint's view (prompts with images): refused by name
    view = {"model_type": "qwen3", ORIGINAL: {"model_type": "qwen3_vl"}}
    assert partial_model_problems(_config(base), {"model_type": "qwen3"}) == []
    (problem,) = partial_model_problems(_config(base), view)
    assert "rollout.partial=true with a conditional-generation checkpoint" in problem
    assert partial_model_problems(_config(base[:-1]), view) == []


class FailsOnce(HFRolloutEngine):
    """Raises on its third generate call (a round of the second step), once."""

    def _generate(self, prompts, params):
        if self.num_generate_calls == 3 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("injected engine failure")
        return super()._generate(prompts, params)


def test_failed_round_is_retried_with_the_same_rows(model_dir, tmp_path):
    """On the rounds path, a generate call that fails is retried (rollout.max_retries) with the
    same prefixes, seeds and step offsets: the run equals the one without the failure; the
    retry is counted. (The step driver path makes no retries: the test below.)"""
    want = _collector(RoundsCollector, HFRolloutEngine(model_dir, dtype=torch.float32),
                      model_dir, tmp_path / "a")
    got = _collector(RoundsCollector, FailsOnce(model_dir, dtype=torch.float32), model_dir,
                     tmp_path / "b", ["rollout.retry_wait_s=0"])
    retries = 0.0
    for s in range(1, 4):
        a, b = want.collect(dump_step=s), got.collect(dump_step=s)
        assert (a.response_ids, a.rollout_logprobs) == (b.response_ids, b.rollout_logprobs)
        retries += b.metrics["rollout/retries"]
    assert got.pool.engine.failed and retries == 1


def test_dapo_keeps_its_meaning_under_partial_rollouts(model_dir, tmp_path):
    """algorithm=dapo: a complete group whose scores all agree is dropped and counted, the
    overlong penalty is that of each reply's whole length, and a reward model's score (the
    pool's scorer) joins reward.fn's, as without partial rollouts."""
    from engine.rl.algo.overlong import overlong_penalty

    engine = HFRolloutEngine(model_dir, dtype=torch.float32)
    c = _collector(PartialCollector, engine, model_dir, tmp_path,
                   ["algorithm=dapo", "dapo.overlong_buffer=8", "dapo.max_gen_batches=4",
                    "reward.fn=tests.rl_rewards:parity_reward", "reward.model.weight=0.5"])
    c.pool.scorer = lambda ids: [float(len(x) % 3) for x in ids]   # a stand-in reward model
    dropped = 0.0
    for step in range(1, 4):
        batch = c.collect(dump_step=step)
        dropped += batch.metrics["rollout/partial_dropped_groups"]
        records = _records(tmp_path / f"step_{step}.jsonl")
        for g in range(0, len(batch), 2):
            assert batch.scores[g] != batch.scores[g + 1]     # signal in every trained group
        for r, reward in zip(records, batch.rewards):
            n = sum(r["loss_mask"])
            want = float(overlong_penalty(torch.tensor([float(n)]), 16, 8, 1.0)[0])
            assert r["overlong_penalty"] == pytest.approx(want)
            assert r["rm_score"] == float(len(r["token_ids"]) % 3)
            assert reward == pytest.approx(r["reward"] + want)
    assert dropped > 0


class FailingStep:
    """A step driver whose first step raises."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected engine step failure")
        return self.inner.step()


class WrappedDriverCollector(PartialCollector):
    """PartialCollector whose step driver is wrapped in `wrapper` (a test's injected failure)."""

    wrapper = FailingStep

    def step_driver(self):
        return self.wrapper(super().step_driver())


class FailingCollector(WrappedDriverCollector):
    wrapper = FailingStep


def test_failing_driver_steps_stop_the_run_and_empty_the_engine(model_dir, tmp_path):
    """A session whose driver step fails every time: rollout.max_retries more sessions from the
    same state, then collect raises; every row of the session was aborted (nothing stays in
    the engine)."""
    c = _collector(FailingCollector, HFRolloutEngine(model_dir, dtype=torch.float32), model_dir,
                   tmp_path, ["train.prompts_per_step=4", "rollout.retry_wait_s=0",
                              "rollout.max_retries=2"])
    with pytest.raises(RuntimeError, match="injected engine step failure"):
        c.collect(dump_step=1)
    assert c.driver.calls == 1 and not c.driver.busy
    assert [e[0] for e in c.driver.events].count("aborted") > 0


class DiesOnce(HFRolloutEngine):
    """An engine that dies (is_alive False) at the 5th driver step of the run, once (a class
    flag: the restarted engine works)."""

    died = False
    steps = 0
    dead = False

    @property
    def is_alive(self) -> bool:
        return not self.dead


class DyingStep(FailingStep):
    def step(self):
        DiesOnce.steps += 1
        if DiesOnce.steps == 5 and not DiesOnce.died:
            DiesOnce.died = True
            self.inner.engine.dead = True
            raise RuntimeError("injected engine death")
        return self.inner.step()


class DyingCollector(WrappedDriverCollector):
    wrapper = DyingStep


def test_failed_driver_session_is_run_again_and_equals_the_straight_run(model_dir, tmp_path):
    """A driver step that fails mid-session: the session runs again from the state it started
    from, on a restarted engine when the engine died (RolloutPool.restart), and the run equals
    the straight one (a session is a function of its start state and the weights); the
    restart is counted. Control: a pool that cannot restart raises."""
    from engine.generation.placement import EnginePlacement
    from engine.generation.pool import RolloutPool

    straight = _collector(PartialCollector, HFRolloutEngine(model_dir, dtype=torch.float32),
                          model_dir, tmp_path / "a")
    engines = []

    def factory():
        engines.append(DiesOnce(model_dir, dtype=torch.float32))
        return engines[-1]

    cfg = _config(BASE + [f"logging.rollout_dir={tmp_path / 'b'}", "rollout.retry_wait_s=0"])
    pool = RolloutPool(EnginePlacement(1, 1, 1, 1, (0,)), factory(), cfg.rollout,
                       factory=factory, resync=lambda engines: None)   # fixed weights
    DiesOnce.died, DiesOnce.steps = False, 0
    from transformers import AutoTokenizer
    got = DyingCollector(pool, ROWS, AutoTokenizer.from_pretrained(model_dir),
                         load_reward_fn("math"), cfg)
    restarts = 0.0
    for s in range(1, 5):
        a, b = straight.collect(dump_step=s), got.collect(dump_step=s)
        assert (a.response_ids, a.rollout_logprobs, a.advantages) == (
            b.response_ids, b.rollout_logprobs, b.advantages), s
        restarts += b.metrics["rollout/restarts"]
    assert DiesOnce.died and restarts == 1 and len(engines) == 2
    DiesOnce.died, DiesOnce.steps = False, 0
    local = _collector(DyingCollector, DiesOnce(model_dir, dtype=torch.float32),
                       model_dir, tmp_path / "c", ["rollout.retry_wait_s=0"])
    with pytest.raises(RuntimeError, match="cannot restart"):
        for s in range(1, 5):
            local.collect(dump_step=s)


def _session_events(driver) -> dict[str, tuple[int, int]]:
    """key -> (step added, step finished or aborted) from a driver's events."""
    spans: dict[str, list[int]] = {}
    for kind, key, step in driver.events:
        if kind == "added":
            spans[key] = [step, -1]
        else:
            spans[key][1] = step
    return {k: (a, b) for k, (a, b) in spans.items()}


def test_driver_session_admits_rows_as_slots_free(model_dir, tmp_path):
    """One session per step on the hf step driver: rows are added at driver steps > 0 while rows
    added before are still running (slots refilled mid-session), whole groups at a time, never
    more rows in flight than ceil(partial_oversample x prompts_per_step) x n; the session ends
    with its unfinished rows aborted (carried). Control: the rounds path runs generate calls and
    no driver."""
    c = _collector(PartialCollector, HFRolloutEngine(model_dir, dtype=torch.float32), model_dir,
                   tmp_path, ["train.prompts_per_step=4", "rollout.partial_oversample=1.5"])
    late = 0
    for step in range(1, 4):
        batch = c.collect(dump_step=step)
        assert batch.metrics["rollout/num_gen_batches"] == 1.0
        spans = _session_events(c.driver)
        for key, (added, _) in spans.items():
            if added > 0:
                late += any(a < added < e for k, (a, e) in spans.items() if k != key)
        for t in range(c.driver.steps + 1):   # rows in flight after each step's admissions
            assert sum(a <= t < e for a, e in spans.values()) <= 6 * 2
        added_at: dict[int, list[str]] = {}
        for key, (added, _) in spans.items():
            added_at.setdefault(added, []).append(key)
        for when, keys in added_at.items():   # groups join whole after the session's start
            if when > 0:
                assert len(keys) == 2 * len({k.split("/")[0] for k in keys}), keys
        aborted = [e for e in c.driver.events if e[0] == "aborted"]
        assert len(aborted) == batch.metrics["rollout/partial_carried"]
        assert 0 < batch.metrics["rollout/engine_fill"] <= 1
    assert late > 0
    engine = c.pool.engine
    assert engine.num_generate_calls == 0   # the sessions ran on the driver alone
    rounds = _collector(RoundsCollector, engine, model_dir, tmp_path / "r",
                        ["train.prompts_per_step=4"])
    rounds.collect(dump_step=1)
    assert rounds.driver is None and engine.num_generate_calls > 0


def _dump(path) -> list[str]:
    return sorted(p.name + p.read_text() for p in path.glob("step_*.jsonl"))


def test_driver_sessions_repeat_exactly(model_dir, tmp_path):
    """Two collectors with the same seed on fresh hf engines: identical metrics (wall-time ones
    aside) and dumps (token_versions included); another seed (negative control) gives other
    dumps."""
    def run(where, seed):
        c = _collector(PartialCollector, HFRolloutEngine(model_dir, dtype=torch.float32),
                       model_dir, tmp_path / where, [f"seed={seed}"])
        ms = [c.collect(dump_step=s).metrics for s in range(1, 5)]
        return [{k: v for k, v in m.items() if not k.startswith("time/")
                 and k != "rollout/tokens_per_s"} for m in ms], _dump(tmp_path / where)

    a, b, other = run("a", 1), run("b", 1), run("c", 2)
    assert a == b and a[1] and "token_versions" in a[1][0]
    assert other[1] != a[1]


def test_the_driver_path_on_a_pool_it_does_not_serve_is_refused_by_name():
    """rollout.partial_driver=true on a pool of two engines: refused naming the key (never a
    silent fallback to rounds); false: the rounds (no driver) on any pool."""
    from types import SimpleNamespace
    pool = SimpleNamespace(num_engines=2, engine=None)
    on = SimpleNamespace(use_driver=True, cfg=_config(BASE), pool=pool)
    with pytest.raises(ValueError, match=re.escape("rollout.partial_driver=true needs a pool "
                                                   "of one engine")):
        PartialCollector.step_driver(on)
    off = SimpleNamespace(use_driver=True, cfg=_config(BASE[:-1]), pool=pool)
    assert PartialCollector.step_driver(off) is None


class CutAnyway(PartialCollector):
    """The previous rule (negative control): a step cuts replies at the staleness bound too,
    and the next step restarts them."""

    def must_finish(self, version: int) -> bool:
        return False


class CutAnywayRounds(CutAnyway):
    use_driver = False


@pytest.mark.parametrize("path", ["driver", "rounds"])
def test_no_reply_is_carried_past_the_staleness_bound(model_dir, tmp_path, path):
    """rollout.partial_max_staleness=1 over 8 steps (max_new_tokens 16, rounds of 4 tokens):
    no reply restarts, none a step trains spans more than one version and none carried spans
    one already (it would span two at the next step), while some reply spans the bound (the
    bound is reached); cutting such replies anyway (negative control: the previous rule) makes
    later steps restart them."""
    cls, control = ((PartialCollector, CutAnyway) if path == "driver"
                    else (RoundsCollector, CutAnywayRounds))

    def run(kind, where):
        c = _collector(kind, HFRolloutEngine(model_dir, dtype=torch.float32), model_dir,
                       tmp_path / where, ["rollout.partial_max_staleness=1"])
        metrics, carried = [], []
        for s in range(1, 9):
            metrics.append(c.collect(dump_step=s).metrics)
            carried += [r.span() for g in c.groups for r in g.replies if r.versions]
        return metrics, carried

    metrics, carried = run(cls, "bounded")
    assert sum(m["rollout/partial_restarts"] for m in metrics) == 0
    assert max(m["rollout/version_span_max"] for m in metrics) == 1
    assert carried and max(carried) == 0
    old, _ = run(control, "cut")
    assert sum(m["rollout/partial_restarts"] for m in old) > 0
