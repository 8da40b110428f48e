"""Reward models (Bradley-Terry on preference pairs): `python -m engine.rm` (__main__.py: parse
and validate before any process group exists), the run (training.py), the pair loss on the score
of each side's end-of-turn (last trained) token (loss_fn.py) and the recipe check
(recipe_check.py).
docs/preference.md ("Reward models").

May import every other engine package but sft and rl (it reuses engine.dpo's per-sequence CP
sums); nothing imports it.
"""
