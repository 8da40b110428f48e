"""Scoring overlapped with generation on the step driver (engine.rl.collect.partial_scoring):
replies go to the reward pool as they finish, and the rollout batches (rewards, advantages,
tokens, dumps) are bitwise those of scoring each group when it completes.

The reward pool's workers import this module to unpickle `slow_parity`, so the heavy imports
(torch, the engines) are inside the test."""
from __future__ import annotations

import time


def slow_parity(prompt, response, answer, **fields):
    """1 for a response of odd length in characters, + 0.25 when it holds the answer, + a
    hundredth per prompt (so two rows' identical replies score apart), after 5 ms of 'work'."""
    time.sleep(0.005)
    return (float(len(response) % 2) + 0.25 * (str(answer) in response)
            + 0.01 * (sum(map(ord, prompt)) % 7))


def test_overlapped_scoring_gives_the_batches_of_scoring_after_generation(tmp_path):
    """Three steps of the hf step driver, overlap on and off: identical batches and metrics
    (time/* aside); with overlap, replies were submitted during the session and queued groups
    were scored at the step's end. Negative controls: another reward changes the batches; a
    score keyed by the reply's tokens alone (not its row) fails the equality (checked by hand:
    identical short replies of different rows then share a score)."""
    import torch   # the engines: kept out of the reward workers' import of this module
    from transformers import AutoTokenizer

    from engine.config.schema import load_config
    from engine.generation.hf.backend import HFRolloutEngine
    from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
    from engine.rl.collect.partial import PartialCollector
    from engine.rl.config import RLConfig
    from engine.rl.rewards import load_reward_fn
    from tools.bench.partial import eos_prone_model

    model_dir = eos_prone_model(str(tmp_path / "qwen3"), eos_scale=2.5)
    rows = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i % 7)}
            for i in range(24)]
    argv = ["rollout.n=4", "train.prompts_per_step=3", "rollout.max_new_tokens=16",
            "data.shuffle=false", "train.seq_length=64", "rollout.partial=true",
            "rollout.partial_max_new_tokens=4", "rollout.partial_driver=true",
            "reward.num_workers=2"]
    cfg = apply_algorithm_defaults(load_config(RLConfig, argv)[0], explicit_keys(argv))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(overlap: bool, reward=slow_parity):
        collector = PartialCollector(HFRolloutEngine(model_dir, dtype=torch.float32), rows,
                                     tokenizer, reward, cfg)
        collector.overlap_scoring = overlap
        submitted, pending = [], []
        submit, settle = collector.scorer.submit, collector.settle_scores
        collector.scorer.submit = lambda k, item: (submitted.append(k), submit(k, item))[1]
        collector.settle_scores = lambda log: (
            pending.append(len(getattr(collector, "unscored", []))), settle(log))[1]
        try:
            batches = [collector.collect(dump_step=s) for s in range(1, 4)]
        finally:
            collector.scorer.close()
        keep = [{k: v for k, v in b.metrics.items() if not k.startswith("time/")
                 and k != "rollout/tokens_per_s"} for b in batches]
        data = [(b.response_ids, b.rewards, b.scores, b.advantages) for b in batches]
        return data, keep, batches, len(submitted), sum(pending)

    after, after_metrics, after_batches, after_submitted, _ = run(False)
    over, over_metrics, over_batches, over_submitted, over_pending = run(True)
    assert over == after and over_metrics == after_metrics
    assert after_submitted == 0 and over_submitted > 0 and over_pending > 0
    assert any(s not in (0.0, 1.0) for b in over_batches for s in b.scores)   # answers count
    for batch in over_batches:
        assert {"time/reward_s", "time/reward_wait_s", "reward/timeouts",
                "reward/failures"} <= set(batch.metrics)
        assert batch.metrics["reward/timeouts"] == batch.metrics["reward/failures"] == 0.0
    other, *_ = run(True, load_reward_fn("math"))
    assert [d[1] for d in other] != [d[1] for d in over]
