"""GRPO / DAPO reinforcement learning: `python -m engine.rl` (__main__.py), the RL step (loop.py,
update.py), rollout engines and their placement (rollout/), rewards, advantages, policy losses,
weight sync.

May import every other engine package; nothing imports it.
"""
