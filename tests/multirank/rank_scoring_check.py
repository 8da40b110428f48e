"""Multi-rank check of engine.rl.collect.rank_scoring (tests/test_rewards_ranks.py): rank 0
scores through RankScorer while the other ranks serve the pool's commands, as in a colocated
RL run. Light at the top: the reward workers unpickle `logged_reward` from here."""
from __future__ import annotations

import os
import time


def logged_reward(prompt, response, answer, log=None, item=None, **_):
    """A deterministic score; appends "<RANK> <item>" to `log` (which rank scored it).
    Responses "hang", "crash" and "raise" misbehave."""
    with open(log, "a") as f:
        f.write(f"{os.environ.get('RANK', '?')} {item}\n")
    if response == "hang":
        time.sleep(3600)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise ValueError("bad item")
    return len(response) / 7.0 + float(answer) / 3.0 - len(prompt) * 1e-3


def items(log: str, count: int) -> list[dict]:
    """`count` items; 5, 6 and 7 hang, crash and raise."""
    special = {5: "hang", 6: "crash", 7: "raise"}
    return [{"prompt": "p" * (i % 4), "response": special.get(i, "r" * (i % 5 + 1)),
             "answer": str(i % 3), "log": log, "item": i} for i in range(count)]


def check(log_dir: str, count: int, broken_split: str | None = None) -> dict:
    """Every rank: a RolloutPool of this world (no engine needed: only reward commands). Rank 0
    scores one batch (`score`) into <log_dir>/batch.log and the same items submitted one by one
    and waited for in another order (`wait`) into <log_dir>/stream.log. `broken_split` (negative
    controls): "overlap", shares that overlap by one item; "rank0", rank 0 scores every item
    (the behaviour before rank_scoring)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from engine.generation.placement import EnginePlacement
    from engine.generation.pool import RolloutPool
    from engine.rl.collect import rank_scoring
    from engine.rl.rewards.cpus import default_num_workers

    if broken_split:
        good = rank_scoring.shares
        rank_scoring.shares = (
            (lambda n, w: [range(max(0, r.start - 1), r.stop) for r in good(n, w)])
            if broken_split == "overlap" else
            (lambda n, w: [range(n)] + [range(0)] * (w - 1)))
    world = dist.get_world_size()
    pool = RolloutPool(EnginePlacement(1, 1, 1, world, (0,)), None, None)
    try:
        if dist.get_rank() != 0:
            pool.serve()
            return {"workers": pool.rank_state["reward"]["pool"].num_workers}
        reward = SimpleNamespace(num_workers=None, timeout_s=2.0, failure_score=-1.0)
        scorer = rank_scoring.RankScorer(logged_reward, reward, pool)
        out = {"spreads": rank_scoring.spreads(pool, scorer)}
        batch = scorer.score(items(os.path.join(log_dir, "batch.log"), count))
        out["batch"] = {"scores": batch.scores, "errors": batch.errors,
                        "metrics": scorer.take_metrics()}
        stream = items(os.path.join(log_dir, "stream.log"), count)
        keys = [("row", i) for i in range(count)]
        for key, item in zip(keys, stream):
            scorer.submit(key, item)
        scorer.submit(keys[0], stream[0])        # a key again: not scored twice
        order = keys[::-1] + keys[:2]             # another order, keys repeated
        report = scorer.wait(order)
        out["stream"] = {"order": [k[1] for k in order], "scores": report.scores,
                         "errors": report.errors, "metrics": scorer.take_metrics()}
        scorer.forget()
        out["workers"] = pool.rank_state["reward"]["pool"].num_workers
        out["default_workers"] = default_num_workers()
        pool.finish(None)
        return out
    finally:
        if broken_split:
            rank_scoring.shares = good
        state = pool.rank_state.get("reward")
        if state and state["pool"] is not None:
            state["pool"].close()


def logged_run_reward(prompt, response, answer, **fields):
    """reward.fn of the RL runs of tests/test_rewards_ranks.py: the digit fraction of the
    response plus its length / 100 (varies within a group); appends this process's RANK to
    and the item (JSON: [rank, prompt, response]) to the file $RANK_SCORING_LOG."""
    import json
    with open(os.environ["RANK_SCORING_LOG"], "a") as f:
        f.write(json.dumps([os.environ.get("RANK", "?"), prompt, response]) + "\n")
    return sum(c.isdigit() for c in response) / max(len(response), 1) + len(response) / 100
