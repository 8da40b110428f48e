"""vLLM's sampling fields without a server (engine.api.sampling_fields, engine.generation
.processing): `serve` parses them with vLLM's ranges, the agent endpoint refuses them in its
own words, and the hf backend's shaping equals vLLM 0.32's own operators (apply_all_penalties,
the min-p processor's formula, apply_top_k_only) on random logits. The end-to-end checks against
vLLM's server and transformers' processors: tests/test_serve_sampling.py (second tier).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.api.backend import GenerateRequest
from engine.api.requests import ApiError, Limits, parse_completion
from engine.api.sampling_fields import FieldError, SamplingFields, check_vocabulary
from engine.generation.processing import row_stops, shape
from engine.generation.sampling import draw
from engine.serve.batching import fingerprint

SERVE = Limits(max_new_tokens=64, seq_length=512, temperature=1.0, top_p=1.0,
               fixed_sampling=False, evaluation=True)
AGENT = Limits(max_new_tokens=64, seq_length=512, temperature=1.0, top_p=1.0)
BODY = {"prompt": [5, 6, 7], "max_tokens": 10}


def _sampling(limits: Limits, **fields):
    return parse_completion({**BODY, **fields}, limits).sampling


def test_serve_parses_each_field_as_vllm():
    got = _sampling(SERVE, top_k=5, min_p=0.1, repetition_penalty=1.3, presence_penalty=-0.5,
                    frequency_penalty=2, logit_bias={"9": 250, 4: -1.5}, ignore_eos=True,
                    min_tokens=10, stop_token_ids=[8, 8, 2])
    assert got == SamplingFields(top_k=5, min_p=0.1, repetition_penalty=1.3,
                                 presence_penalty=-0.5, frequency_penalty=2.0,
                                 logit_bias=((4, -1.5), (9, 100.0)), ignore_eos=True,
                                 min_tokens=10, stop_token_ids=(8, 2))
    # neutral values (top_k -1 is vLLM's "off" too) are no fields at all
    assert _sampling(SERVE, top_k=-1, min_p=0, repetition_penalty=1, logit_bias={},
                     ignore_eos=False, min_tokens=0, stop_token_ids=[]) is None
    assert got.stop_ids([3]) == {8, 2} and dataclasses.replace(got, ignore_eos=False
                                                               ).stop_ids([3]) == {8, 2, 3}
    assert got.min_tokens_masked([3]) == {8, 2, 3}


@pytest.mark.parametrize("field,value,says", [
    ("top_k", -2, "top_k must be an integer >= -1"), ("min_p", 1.5, "min_p must be a number"),
    ("repetition_penalty", 0, "repetition_penalty must be a number in (0"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("logit_bias", {"x": 1}, "logit_bias must name token ids"),
    ("ignore_eos", "yes", "ignore_eos must be a boolean"),
    ("min_tokens", 11, "min_tokens=11 must be <= max_tokens=10"),
    ("stop_token_ids", ["a"], "stop_token_ids must be a list")])
def test_serve_refuses_bad_values_naming_the_field(field, value, says):
    with pytest.raises(ApiError) as e:
        _sampling(SERVE, **{field: value})
    assert e.value.status == 400 and e.value.param == field and says in e.value.message


def test_serve_refuses_ids_outside_the_vocabulary():
    with pytest.raises(FieldError, match=r"names token ids outside .*\[200\]") as e:
        check_vocabulary(SamplingFields(stop_token_ids=(5, 200)), 200)
    assert e.value.param == "stop_token_ids"
    check_vocabulary(SamplingFields(stop_token_ids=(5, 199)), 200)


@pytest.mark.parametrize("field,value", [
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("logit_bias", {"5": 1}), ("ignore_eos", True),
    ("min_tokens", 3), ("stop_token_ids", [5])])
def test_the_agent_endpoint_keeps_refusing_them(field, value):
    with pytest.raises(ApiError) as e:
        _sampling(AGENT, **{field: value})
    assert e.value.param == field and "it changes what the policy samples" in e.value.message
    neutral = {"top_k": 0, "min_p": 0, "repetition_penalty": 1, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": {}, "ignore_eos": False, "min_tokens": 0,
               "stop_token_ids": []}[field]
    assert _sampling(AGENT, **{field: neutral}) is None


def test_shaping_equals_vllms_operators():
    """Rows 0 and 2 shaped, row 1 without fields (left as it is); logits -> vLLM's
    apply_all_penalties with the same prompts and outputs, the logit bias and min-tokens mask
    added by hand as vLLM's processors do (an index add, a -inf fill)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    prompts, outputs = [[1, 2, 2, 9], [4], [7, 8]], [[9, 9, 5, 1], [4, 4], [30]]
    fields = [SamplingFields(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.9,
                             logit_bias=((5, 2.5), (6, -1.0)), top_k=4, min_p=0.2),
              None, SamplingFields(repetition_penalty=0.8, min_tokens=3, stop_token_ids=(11,),
                                   top_k=7)]
    got = shape(logits, fields, prompts, outputs, [3])
    want = logits.clone()
    want[0, [5, 6]] += torch.tensor([2.5, -1.0])
    want[2, [3, 11]] = float("-inf")
    pad = 50
    prompt_t = torch.tensor([p + [pad] * (4 - len(p)) for p in prompts])
    apply_all_penalties(want, prompt_t, torch.tensor([0.4, 0.0, 0.0]),
                        torch.tensor([0.9, 0.0, 0.0]), torch.tensor([1.7, 1.0, 0.8]), outputs)
    want[1] = logits[1]
    assert torch.equal(got.logits, want)
    assert torch.equal(logits, logits.clone()) and not torch.equal(got.logits[0], logits[0])
    # temperature, min-p (vLLM's MinPLogitsProcessor formula), top-k (apply_top_k_only)
    z = want / 0.7
    p = torch.softmax(z, dim=-1)
    z = z.masked_fill((p < p.amax(-1, keepdim=True) * torch.tensor([[0.2], [0.0], [0.0]])),
                      float("-inf"))
    z = apply_top_k_only(z.clone(), torch.tensor([4, 50, 7]))
    assert torch.allclose(got.probs(0.7), torch.softmax(z, dim=-1), atol=1e-7, rtol=0)
    assert (got.probs(0.7)[0] > 0).sum() <= 4 and (got.probs(0.7)[2] > 0).sum() == 7


def test_draw_keeps_the_contracts_logprobs_and_other_rows():
    """Shaping moves the draw, never the log-prob (log_softmax(logits / T) of the unshaped
    logits) nor a row without fields; no fields at all: no shaping (None)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 40, generator=g)
    fields = [SamplingFields(logit_bias=((17, 30.0),)), None]
    shaping = shape(logits, fields, [[1], [1]], [[], []], [3])
    u = torch.tensor([0.3, 0.6], dtype=torch.float64)
    token, logprob = draw(logits, 0.8, 1.0, u, shaping)
    plain_token, plain_logprob = draw(logits, 0.8, 1.0, u)
    assert int(token[0]) == 17 and int(plain_token[0]) != 17
    assert float(logprob[0]) == pytest.approx(float(torch.log_softmax(logits[0] / 0.8, -1)[17]))
    assert int(token[1]) == int(plain_token[1]) and float(logprob[1]) == float(plain_logprob[1])
    greedy, _ = draw(logits, 0.0, 1.0, None, shaping)
    assert int(greedy[0]) == 17 and int(greedy[1]) == int(logits[1].argmax())
    assert shape(logits, [None, None], [[1], [1]], [[], []], [3]) is None
    assert row_stops([SamplingFields(ignore_eos=True, stop_token_ids=(9,)), None], [3], 2) == \
        [frozenset({9}), frozenset({3})]


def test_failed_twins_tell_sampling_fields_apart():
    """A request that failed alone refuses its twins: the same request with other sampling
    fields is not one."""
    a = GenerateRequest((1, 2), 5, 1.0, 1.0, 0)
    b = dataclasses.replace(a, sampling=SamplingFields(top_k=2))
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(b) == fingerprint(dataclasses.replace(b, seed=9))


def test_a_continued_row_with_fields_is_refused():
    """Presence, frequency and min_tokens count the reply's tokens; a row continued across
    calls (first_steps = k > 0: its k earlier reply tokens are at the end of its prompt) would
    count only this call's, unlike one uninterrupted request, on both backends. No caller
    combines them (rollout.partial continues rows without fields; `serve` sends fields and
    never continues): SamplingParams refuses the combination by row, so none can. A continued
    row without fields and a fresh row with fields stay accepted. Fails on the previous code
    (accepted)."""
    from engine.generation.base import SamplingParams

    fields = SamplingFields(frequency_penalty=1.0, min_tokens=3)
    with pytest.raises(ValueError, match=r"prompts \[1\] continue a reply \(first_steps > 0\)"
                                         " with sampling fields"):
        SamplingParams(max_new_tokens=4, first_steps=[2, 2], sampling=[None, fields])
    SamplingParams(max_new_tokens=4, first_steps=[2, 0], sampling=[None, fields])


def test_vllm_request_arguments():
    """The vllm backend's request: the fields as vLLM's keywords, its stop ids (eos dropped
    under ignore_eos), min_tokens at most max_tokens (vLLM refuses a larger one: a request
    capped by --max-tokens must not fail); no fields: the keywords of a plain request."""
    from vllm import SamplingParams as VLLMParams

    from engine.generation.base import SamplingParams
    from engine.generation.vllm.requests import sampling_args, stop_ids

    fields = SamplingFields(top_k=4, min_p=0.1, repetition_penalty=1.2, logit_bias=((5, 1.0),),
                            ignore_eos=True, min_tokens=50, stop_token_ids=(9,))
    args = sampling_args(SamplingParams(max_new_tokens=10, seeds=[1], sampling=[fields]), 0, 1,
                         [3])
    built = VLLMParams(**args)
    assert (built.top_k, built.min_p, built.repetition_penalty, built.logit_bias,
            built.min_tokens, built.ignore_eos) == (4, 0.1, 1.2, {5: 1.0}, 10, True)
    assert stop_ids(built) == {9} and built.stop_token_ids == [9]
    plain = sampling_args(SamplingParams(max_new_tokens=10, seeds=[1]), 0, 1, [3])
    assert plain == sampling_args(SamplingParams(max_new_tokens=10, seeds=[1], sampling=[None]),
                                  0, 1, [3])
    assert stop_ids(VLLMParams(**plain)) == {3} and "min_tokens" not in plain
    kept = sampling_args(SamplingParams(max_new_tokens=10, seeds=[1], sampling=[
        dataclasses.replace(fields, ignore_eos=False)]), 0, 1, [3])
    assert stop_ids(VLLMParams(**kept)) == {3, 9}   # eos kept: SamplingFields.stop_ids' rule


def test_hf_eager_loop_equals_the_step_driver(tmp_path):
    """The hf engine's `generate` (the eager loop, SamplingBackend's path) and its step driver
    (serve's path) give the same tokens and finish reasons for rows with different fields in
    one call, greedy and seeded; ignore_eos runs to the bound, a stop id ends a row "stop"."""
    from engine.generation.base import SamplingParams
    from engine.generation.hf.backend import HFRolloutEngine
    from engine.generation.hf.stepper import HFStepDriver
    from tools.tiny_models import build_tiny_model

    engine = HFRolloutEngine(build_tiny_model(str(tmp_path / "m"), "llama", layers=2, seed=3),
                             dtype=torch.float32)
    prompts = [[10, 20, 30], [10, 20, 30], [44, 5], [7, 8, 9, 10]]
    fields = [None, SamplingFields(repetition_penalty=1.5, top_k=5, min_p=0.05),
              SamplingFields(ignore_eos=True, logit_bias=((3, 5.0),)),
              SamplingFields(stop_token_ids=(11,), logit_bias=((11, 9.0),), min_tokens=3)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seeds=[1, 1, 2, 3],
                                sampling=fields)
        eager = engine.generate(prompts, params)
        driver = HFStepDriver(engine)
        for i, prompt in enumerate(prompts):
            driver.add(str(i), prompt, params.rows([i]))
        stepped = {}
        while driver.busy:
            stepped.update({o.key: o.done for o in driver.step() if o.done is not None})
        for i, gen in enumerate(eager):
            assert (gen.response_ids, gen.finish_reason) == (
                stepped[str(i)].response_ids, stepped[str(i)].finish_reason), (temperature, i)
        assert len(eager[2].response_ids) == 12 and eager[2].finish_reason == "length"
        assert 3 in eager[2].response_ids                       # eos sampled, not the end
        assert eager[3].response_ids[-1] == 11 and eager[3].finish_reason == "stop"
        assert len(eager[3].response_ids) > 3        # 11 masked for min_tokens, then drawn
        assert temperature == 0 or eager[0].response_ids != eager[1].response_ids
