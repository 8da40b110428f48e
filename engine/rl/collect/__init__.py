"""One rollout batch: the batch type and the training sequences built from it, prompts and
their length fit, the collector (generate, score, shape, filter, advantages; failed_groups:
the groups a failed reward call drops; episode_rows: agent episodes regrouped for dynamic
sampling), its transport to every rank, and validation (pass@k)
through the same collector.

May import: engine.rl.agent, engine.rl.algo, engine.rl.env, engine.generation, engine.rl.rewards,
engine.data, engine.training, engine.run, engine.errors.
"""
