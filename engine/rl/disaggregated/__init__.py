"""Rollout on ranks of its own (`rollout.placement=disaggregated`): the job split into a
training world and a rollout world, the fixed-lag version schedule, the trainer's side
(batches in, versions out), the rollout ranks' side, the weight send and the receiving inbox,
the checks of the asynchronous keys and the behaviour-version check
(rollout.check_behaviour_logprobs).

May import: engine.rl.collect, engine.rl.judge (the collector with an LLM judge),
engine.rl.policy, engine.generation, engine.rl.env, engine.rl.algo, engine.rl.rewards,
engine.rl.config, engine.training, engine.errors.
"""
