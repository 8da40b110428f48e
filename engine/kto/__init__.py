"""KTO on unpaired feedback (a prompt, a completion, a boolean label): `python -m engine.kto`
(__main__.py: parse and validate before any process group exists), the run (training.py), the
per-example loss (loss.py), the micro-batch loss with the global KL reference point
(loss_fn.py) and the recipe check (recipe_check.py). docs/preference.md ("KTO").

May import every other engine package but sft, rl, dpo and rm (the reference, the per-sequence
context-parallel sums and the run loop it shares with them are engine.preference's); nothing
imports it.
"""
