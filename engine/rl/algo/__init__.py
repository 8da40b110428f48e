"""The RL math, pure and local (no process groups except seq_reduce's CP sum): the registries
and algorithm presets, advantage estimators, per-token policy losses, rollout correction (IS
weights and rejection), dynamic sampling, the overlong penalty, whole-sequence reductions.

May import: engine.config, engine.errors, engine.training; nothing else of engine.rl.
"""
