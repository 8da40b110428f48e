"""The trainer's side of an RL step: the log-prob stage (old / proximal, KL reference and MoE
routing replay, one call before the updates), the policy update (one optimizer step per
mini-batch), the weight export shared by the colocated sync and the disaggregated sender.

May import: engine.rl.algo, engine.rl.rollout, engine.training, engine.config, engine.errors.
"""
