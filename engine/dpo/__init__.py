"""Preference optimisation (DPO and its relatives: IPO, cDPO/robust, hinge, SimPO, RPO):
`python -m engine.dpo` (__main__.py: parse and validate before any process group exists), the
run (training.py), the pair losses (pair_loss.py), the micro-batch loss that keeps a pair's
sides in one loss term on every layout (loss_fn.py) and the recipe check (recipe_check.py); the
frozen reference, the per-sequence context-parallel sums and the run loop are the preference
core's (engine.preference). docs/preference.md.

May import every other engine package but sft, rl, kto and rm; nothing imports it.
"""
