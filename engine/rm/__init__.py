"""Reward models (Bradley-Terry on preference pairs): `python -m engine.rm` (__main__.py: parse
and validate before any process group exists), the run (training.py), the pair loss on the score
of each side's end-of-turn (last trained) token (loss_fn.py) and the recipe check
(recipe_check.py).
docs/preference.md ("Reward models").

May import every other engine package but sft, rl, dpo and kto (the per-sequence CP sums, the
run loop and the chunked evaluation it shares with them are engine.preference's); nothing
imports it.
"""
