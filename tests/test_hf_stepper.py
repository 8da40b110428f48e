"""engine.generation.hf.stepper.HFStepDriver (continuous batching of the hf engine over a slot
cache) on a tiny fp32 Llama on the CPU, by events, never clocks:
- greedy and seeded replies equal the engine's own `generate` (tokens; log-probs within TOL,
  the static path's tolerance; over the engine's compiled decoder: test_hf_stepper_compiled);
- the same seeded requests alone and joining a loaded driver at different steps (with slot
  growth and repacks) give equal tokens, log-probs within TOL; negative controls: the same
  request counted from another step (first_steps) or with another row's seed differs;
- a short request added while a long one runs finishes first, after its prefill and 3
  decode steps; a streamed request reports its ids after every step, a plain one only its end;
- abort frees the slot at once (the next request takes it), and scoring equals `score`;
- joining rows are prefilled together (engine.generation.hf.prefill, forwards counted on the
  model): a group sharing one prompt in ONE forward, bitwise the first log-prob each row gets
  alone; distinct prompts of one length in one [B, L] forward, within TOL;
- what the driver does not serve is refused by name.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine.generation.base import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.hf.stepper import HFStepDriver, step_problem
from models.vision.inputs import ImagePrompt
from tools.tiny_models import build_eos_model

# fp32 rounding of a masked static cache: the static path's 3e-6 (tests/test_hf_rollout_static.py)
# was measured on 12-token replies; on REQUESTS (up to 40 tokens, 30-token prompts) the eager
# loop itself moves a row's log-probs by up to 4.8e-6 between decoding it alone and in one
# batch with the others, the driver's differ from `generate` alone by up to 3.7e-6
TOL = 5e-6

# (prompt, seed, temperature, top_p, max_new_tokens): lengths 3-30, so joiners repack the cache
# (seeds: the first whose replies run their length, but r5's, which stops at an eos)
REQUESTS = [([5, 6, 7], 4, 1.0, 1.0, 40), (list(range(20, 50)), 2, 0.7, 0.9, 24),
            ([9, 10], 13, 0.0, 1.0, 16), (list(range(60, 72)), 0, 1.0, 0.95, 30),
            ([100, 101, 102, 103], 0, 1.0, 1.0, 12), (list(range(110, 136)), 0, 1.2, 1.0, 20)]
LONG_SEED = 54   # [10, 11, 12] runs LONG tokens
LONG = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Hidden 32 (TOL's model), eos lowered: the seeds of REQUESTS and LONG_SEED make replies
    that run their length (requests overlap for many steps), r5's stops at an eos."""
    return build_eos_model(str(tmp_path_factory.mktemp("stepper") / "llama"), eos_boost=-3.0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir, device="cpu")


def params(seed, temperature, top_p, max_new, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                          seeds=[seed], **kw)


def run(driver, schedule: dict[int, list[tuple]], stream=()) -> tuple[dict, dict]:
    """Step `driver` until idle, adding schedule[k] = [(key, prompt, SamplingParams)] before
    step k (counted from 0); (key -> Generation, key -> [ids of each streamed output])."""
    done, seen, k = {}, {}, 0
    while driver.busy or any(s >= k for s in schedule):
        for key, prompt, p in schedule.get(k, []):
            driver.add(key, prompt, p, stream=key in stream)
        for o in driver.step():
            if o.done is None:
                seen.setdefault(o.key, []).append(o.ids)
            else:
                done[o.key] = o.done
        k += 1
    return done, seen


def assert_close(got, ref) -> float:
    assert got.response_ids == ref.response_ids
    assert got.finish_reason == ref.finish_reason
    diff = max(abs(a - b) for a, b in zip(got.response_logprobs, ref.response_logprobs))
    assert diff <= TOL, diff
    return diff


def test_replies_equal_generate_and_do_not_depend_on_the_load(engine):
    """Alone (one request in the driver) and under load (all six joining at steps 0, 2, 3, 7,
    8, 11 beside each other): the same tokens as `generate` of the prompt alone, log-probs
    within TOL; the load grew the slots and repacked the cache. Negative controls: the same
    request counted from step 1, or drawing another request's seed, samples other tokens."""
    refs = {f"r{i}": engine.generate([pr], params(*rest))[0]
            for i, (pr, *rest) in enumerate(REQUESTS)}
    assert sorted(r.finish_reason for r in refs.values()) == ["length"] * 5 + ["stop"]
    driver = HFStepDriver(engine)
    alone = {}
    for i, (pr, *rest) in enumerate(REQUESTS):
        alone.update(run(driver, {0: [(f"r{i}", pr, params(*rest))]})[0])
    steps = [0, 2, 3, 7, 8, 11]
    schedule: dict[int, list] = {}
    for i, (pr, *rest) in enumerate(REQUESTS):
        schedule.setdefault(steps[i], []).append((f"r{i}", pr, params(*rest)))
    shapes = len(driver.layout.decoder.shapes)
    loaded, _ = run(driver, schedule)
    for key, ref in refs.items():
        assert_close(alone[key], ref)
        assert_close(loaded[key], ref)
    assert len(driver.layout.decoder.shapes) > shapes   # 6 rows: more than MIN_SLOTS
    assert max(b for b, _ in driver.layout.decoder.shapes) == 8
    assert driver.layout.slots == 0 and not driver.busy   # idle: the layout is forgotten

    pr, seed, temperature, top_p, m = REQUESTS[0]
    shifted = run(driver, {0: [("x", pr, params(seed, temperature, top_p, m,
                                                first_steps=[1]))]})[0]["x"]
    other = run(driver, {0: [("y", pr, params(REQUESTS[1][1], temperature, top_p, m))]})[0]["y"]
    assert shifted.response_ids != refs["r0"].response_ids
    assert other.response_ids != refs["r0"].response_ids


def test_a_short_request_joins_and_finishes_first(engine):
    """A LONG-token request, then at its step 5 a 4-token one: the short one is added while the
    long one runs and finishes 4 steps later (its prefill and 3 decode steps), before the
    long one; both equal `generate`."""
    driver = HFStepDriver(engine)
    long_p, short_p = params(LONG_SEED, 1.0, 1.0, LONG), params(2, 1.0, 1.0, 4)
    done, _ = run(driver, {0: [("long", [10, 11, 12], long_p)],
                           5: [("short", [20, 21], short_p)]})
    events = list(driver.events)
    added = {k: s for e, k, s in events if e == "added"}
    ends = {k: s for e, k, s in events if e == "finished"}
    assert added["long"] < added["short"] < ends["long"]
    assert ends["short"] - added["short"] == 4 and ends["short"] < ends["long"]
    assert len(done["long"].response_ids) == LONG
    assert_close(done["long"], engine.generate([[10, 11, 12]], long_p)[0])
    assert_close(done["short"], engine.generate([[20, 21]], short_p)[0])


def test_streams_report_every_step_and_abort_frees_the_slot(engine):
    """A streamed request reports its ids after every step (1, 2, ... tokens, each a prefix of
    its reply), a plain one nothing before its end. Aborting a running request: an "aborted"
    event, no result, its slot free at once and taken by the next request."""
    driver = HFStepDriver(engine)
    p = params(REQUESTS[0][1], 1.0, 1.0, 10)   # [5, 6, 7] with it runs 40 tokens
    done, seen = run(driver, {0: [("s", [5, 6, 7], p), ("plain", [8, 9], p)]}, stream={"s"})
    assert [len(ids) for ids in seen["s"]] == list(range(1, 10))
    assert all(ids == done["s"].response_ids[:len(ids)] for ids in seen["s"])
    assert "plain" not in seen and done["plain"].response_ids

    driver.add("a", [5, 6, 7], params(REQUESTS[0][1], 1.0, 1.0, 40))
    driver.add("b", [5, 6, 7], params(REQUESTS[0][1], 1.0, 1.0, 40))
    for _ in range(3):
        driver.step()
    slot = {k: s for s, (k, _) in driver.running.items()}["a"]
    driver.abort("a")
    assert ("aborted", "a", driver.steps) == driver.events[-1]
    assert slot in driver.layout.free_slots() and "a" not in driver.layout.left.values()
    driver.add("c", [5, 6, 7], params(REQUESTS[0][1], 1.0, 1.0, 5))
    outputs = driver.step()
    assert {k: s for s, (k, _) in driver.running.items()}["c"] == slot
    assert "a" not in {o.key for o in outputs}
    driver.abort("b")
    driver.abort("c")
    assert not driver.busy and driver.layout.slots == 0
    driver.abort("nothing")   # a key not in the driver: no event
    assert driver.events[-1][1] == "c"


def prefill_shapes(engine):
    """A list that records the input_ids shape of every model forward of more than one
    position (a prefill; decode steps feed one), and the hook's handle."""
    shapes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            shapes.append(tuple(ids.shape))
    return shapes, engine.model.register_forward_pre_hook(hook, with_kwargs=True)


GROUP = [20, 21, 22, 23, 24]   # a group's prompt (4 replies, seeds 0-3)
BESIDE = [7, 8, 9]             # a distinct prompt joining beside it
SAME_LENGTH = ([30, 31, 32, 33], [40, 41, 42, 43])


def test_rows_sharing_a_prompt_are_prefilled_once(engine):
    """Four rows with one prompt (seeds 0-3, a group's replies) and one of another length join
    at one step: two prefill forwards, [1, 5] for the four and [1, 3] beside them (joining one
    by one, the same rows take one each: the count's negative control). Each row: the tokens
    it gets alone and from `generate`, its first log-prob (the shared forward's) bitwise its
    own, the rest within TOL. Negative control: the four seeds draw four different replies
    from the one forward. Two distinct prompts of one length: one [2, 4] forward, the same
    tokens as alone, log-probs within TOL."""
    driver = HFStepDriver(engine)
    requests = [(f"g{s}", GROUP, params(s, 1.0, 1.0, 12)) for s in range(4)]
    requests.append(("b", BESIDE, params(5, 0.8, 0.9, 12)))
    shapes, handle = prefill_shapes(engine)
    try:
        alone = {}
        for key, prompt, p in requests:
            alone.update(run(driver, {0: [(key, prompt, p)]})[0])
        assert shapes == [(1, 5)] * 4 + [(1, 3)]
        shapes.clear()
        together, _ = run(driver, {0: requests})
        assert shapes == [(1, 5), (1, 3)]
        shapes.clear()
        pair = [(f"l{i}", prompt, params(i, 1.0, 1.0, 12)) for i, prompt in enumerate(SAME_LENGTH)]
        batched, _ = run(driver, {0: pair})
        assert shapes == [(2, 4)]
    finally:
        handle.remove()
    for key, prompt, p in requests:
        ref = engine.generate([prompt], p)[0]
        assert_close(together[key], ref)
        assert_close(together[key], alone[key])
        assert together[key].response_logprobs[0] == alone[key].response_logprobs[0]
    assert len({tuple(together[f"g{s}"].response_ids) for s in range(4)}) == 4
    for key, prompt, p in pair:
        assert_close(batched[key], run(driver, {0: [(key, prompt, p)]})[0][key])


def test_the_eager_step_attends_to_the_columns_in_use(engine):
    """A request bounded at 100 tokens (a 128-column cache), a short one joining at step 5:
    every decode step's window (the columns its attention covers) holds every running row's
    columns and the column written, and is narrower than the cache while the rows are short;
    the replies equal `generate`. Negative control: with a compiled decoder the window is the
    whole cache (one shape per cache)."""
    driver = HFStepDriver(engine)
    long_p, short_p = params(LONG_SEED, 1.0, 1.0, 100), params(2, 1.0, 1.0, 4)
    layout, narrower, done, k = driver.layout, 0, {}, 0
    driver.add("long", [10, 11, 12], long_p)
    while driver.busy:
        if k == 5:
            driver.add("short", [20, 21], short_p)
        if layout.start:
            lo, hi = layout.window()
            assert lo <= min(layout.start.values()) and layout.col < hi <= layout.length
            narrower += hi - lo < layout.length
            layout.decoder.compile = True
            assert layout.window() == (0, layout.length)
            layout.decoder.compile = False
        done.update({o.key: o.done for o in driver.step() if o.done is not None})
        k += 1
    assert narrower > 0 and set(done) == {"long", "short"}
    assert_close(done["long"], engine.generate([[10, 11, 12]], long_p)[0])
    assert_close(done["short"], engine.generate([[20, 21]], short_p)[0])


def test_scoring_equals_score(engine):
    driver = HFStepDriver(engine)
    driver.add_scoring("sc", [5, 6, 7, 8, 9], 3)
    (out,) = driver.step()
    (ref,) = engine.score([[5, 6, 7, 8, 9]], 3)
    assert out.key == "sc" and out.ids == [] and out.done.logprobs == ref.logprobs
    assert out.done.top == ref.top and not driver.busy


def test_refusals_by_name(engine):
    driver = HFStepDriver(engine)
    with pytest.raises(ValueError, match="seeds has 2 entries"):
        driver.add("k", [5, 6], SamplingParams(max_new_tokens=4, seeds=[1, 2]))
    with pytest.raises(ValueError, match="outside"):
        driver.add("k", [5, 10 ** 6], params(1, 1.0, 1.0, 4))
    with pytest.raises(ValueError, match="image prompt"):
        driver.add("k", ImagePrompt([5, 6], None, 1, 2), params(1, 1.0, 1.0, 4))
    driver.add("k", [5, 6], params(1, 1.0, 1.0, 4))
    with pytest.raises(ValueError, match="already running"):
        driver.add("k", [5, 6], params(1, 1.0, 1.0, 4))
    driver.abort("k")
    sliding = SimpleNamespace(vision=None, hf_path="m", model=SimpleNamespace(
        config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(
            layer_types=["full_attention", "sliding_attention"]))))
    assert "sliding_attention" in step_problem(sliding)
    with pytest.raises(ValueError, match="vision tower"):
        HFStepDriver(SimpleNamespace(vision=object(), hf_path="m"))
    assert step_problem(engine) is None
