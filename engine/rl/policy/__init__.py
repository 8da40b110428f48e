"""The trainer's side of an RL step: the log-prob stage (old / proximal, KL reference, MoE
routing replay, the critic's values and GAE, the distillation teacher: one call before the
updates), the policy update and the PPO critic (one optimizer step each per mini-batch), the
step driver, and the weight export shared by the colocated sync and the disaggregated sender.

May import: engine.rl.algo, engine.generation, engine.rl.collect (the batch type),
engine.rl.env (the rollout dump), engine.training, engine.config, engine.errors, models.
"""
