"""Reinforcement learning (GRPO, DAPO and their relatives): `python -m engine.rl`.

Packages (one concern each; every `__init__.py` names what it may import):
    algo/           the math: algorithm presets, advantage estimators, policy losses, rollout
                    correction, dynamic sampling, the overlong penalty, sequence reductions
    policy/         the trainer's side of a step: the log-prob stage (old, reference, routing
                    replay) as one call, the policy update, the weight export and colocated sync
    collect/        a rollout batch: the batch type, the collector, prompts, its transport to
                    every rank, validation
    disaggregated/  rollout on ranks of its own (rollout.placement=disaggregated): the split
                    world, the version schedule, the trainer side, the rollout side, weight
                    send and inbox, the asynchronous keys' checks
    env/            multi-turn environments and tools
    rollout/        rollout engines (HF, SGLang, user backends), their placement and pool
    rewards/        reward functions and their contract (math, math_verify, code in a
                    sandbox), scored in a process pool
Modules: config (the schema), checks (every key check), loop (the RL run), recipe_check
(`--validate`), __main__ (the entry point).

May import every other engine package; nothing outside engine.rl imports it.
"""
