"""A request that fails alone on the step path (engine.api.stepping over StepBackend and the hf
step driver), in process on a tiny fp32 Llama whose forward raises on a poisoned prompt (an
injected failure of one request's prefill), by engine steps, never clocks:
- the poisoned request gets its own 503 (GenerationFailed, the injected error as its cause);
- a request that finished in that same step gets its reply, one running beside it goes on,
  and a clean prompt of the poisoned one's length, prefilled in the same batched forward, is
  served (its prompt prefilled again alone): each equal to `generate`;
- the poisoned request's twins (same prompt, another seed) are refused 503 repeated_failure
  without reaching the engine: at admission, and when already queued as it failed;
- the loop keeps serving (it returns normally, nothing left in the driver).
Before the fix the step raised: every running request got 503 and the loop died.
"""
from __future__ import annotations

import functools

import pytest
import torch

from engine.api.backend import GenerateRequest
from engine.api.batcher import GenerationFailed
from engine.api.requests import ApiError
from engine.api.stepping import StepServing
from engine.generation.base import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.hf.stepper import HFStepDriver
from engine.generation.sampling_backend import StepBackend
from engine.serve.batching import CLIENTS, ServeQueue
from tools.tiny_models import build_tiny_model

TOL = 5e-6        # tests/test_hf_stepper.py's
POISON = 150      # a prompt holding it makes the model's prefill raise


def request(prompt, max_tokens, seed, temperature=1.0) -> GenerateRequest:
    return GenerateRequest(tuple(prompt), max_tokens, temperature, 1.0, seed)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(str(tmp_path_factory.mktemp("fail") / "llama"), "llama",
                            hidden=32, layers=2, heads=4, kv_heads=2)
    engine = HFRolloutEngine(path, device="cpu")
    forward = engine.model.forward

    @functools.wraps(forward)
    def poisoned(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 1 and (input_ids == POISON).any():
            raise RuntimeError("poisoned prompt")
        return forward(*args, input_ids=input_ids, **kwargs)

    engine.model.forward = poisoned
    return engine


def reference(engine, r: GenerateRequest):
    (gen,) = engine.generate([list(r.prompt_ids)], SamplingParams(
        max_new_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, seeds=[r.seed]))
    return gen


def assert_equal(result, ref) -> None:
    assert result.ids == ref.response_ids and result.finish_reason == ref.finish_reason
    assert max(abs(a - b) for a, b in zip(result.logprobs, ref.response_logprobs)) <= TOL


class Hooked(StepBackend):
    """StepBackend running `before[step]` just before the driver's step number `step`."""

    def __init__(self, driver, before: dict) -> None:
        super().__init__(driver)
        self.before = before

    def step(self):
        hook = self.before.get(self.driver.steps + 1)
        if hook:
            hook()
        return super().step()


def test_a_request_failing_in_a_step_fails_alone(engine):
    short = request([5, 6, 7], 6, 1)
    long = request([9, 10, 11, 12], 24, 3)
    bad = request([POISON, 20, 21], 8, 2)
    clean = request([30, 31, 32], 8, 4)          # bad's length: one batched prefill forward
    twin, queued_twin = request(bad.prompt_ids, 8, 5), request(bad.prompt_ids, 8, 6)
    refs = {r: reference(engine, r) for r in (short, long, clean)}
    end = len(refs[short].response_ids)           # the step `short` finishes in
    assert end == 6 and len(refs[long].response_ids) == 24

    queue = ServeQueue()
    futures = {}
    backend = Hooked(HFStepDriver(engine), {   # queued while `bad` is prefilled (and fails)
        end: lambda: futures.update(queued=queue.submit(CLIENTS, queued_twin))})
    serving = StepServing(queue, backend)
    loops = iter(range(10 ** 4))

    def until() -> bool:
        i = next(loops)
        if i == 0:
            futures.update(short=queue.submit(CLIENTS, short), long=queue.submit(CLIENTS, long))
        if i == end - 1:    # added before step `end`: prefilled in it, as `short` finishes
            futures.update(bad=queue.submit(CLIENTS, bad), clean=queue.submit(CLIENTS, clean))
        return i >= end

    serving.run(until)
    events = backend.driver.events
    when = {(kind, key.split("-")[1]): step for kind, key, step in events}
    assert when[("failed", "2")] == when[("finished", "0")] == end   # bad's step, short's end
    error = futures["bad"].exception()
    assert isinstance(error, GenerationFailed) and str(error.cause) == "poisoned prompt"
    for name, r in (("short", short), ("long", long), ("clean", clean)):
        assert_equal(futures[name].result(), refs[r])
    refused = futures["queued"].exception()
    assert isinstance(refused, ApiError) and refused.code == "repeated_failure"
    with pytest.raises(ApiError, match="identical request") as e:
        queue.submit(CLIENTS, twin)
    assert e.value.status == 503 and e.value.code == "repeated_failure"
    assert [k for k, _, _ in events].count("added") == 4    # not the queued twin
    assert not backend.busy and not serving.inflight and queue.running == 0
    assert backend.calls == 4
