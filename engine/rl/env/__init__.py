"""Multi-turn RL environments: the `env.fn` contract, token-in/token-out episodes,
the built-in tool environment (`env.fn=tools`), and rollout dumps.

Modules (one job each):
    contract     loading `env.fn`, checking what `step` returns
    stepper      environment calls run concurrently with per-call deadlines
    episodes     the turn loop: one generate call per engine per turn, env steps, masks
    episode_batch  one generation batch of episodes for engine.rl.collect.collector.RolloutCollector
    tool_schema, tool_pool, tool_worker, tools_env   the built-in tool environment (its
                 tool-call formats: engine.data.tool_calls)
    dump         `logging.rollout_dir` JSON lines

Observations are rendered by engine.data.observation (the template delta, shared with the agent
endpoint). May import: engine.api (turn seeds), engine.rl.algo, engine.generation, engine.data,
engine.errors. This package file
imports nothing: tool worker processes import engine.rl.env.tool_worker without torch.
"""
