"""Stacks with dense layers first and MoE layers after them (`spec.py`), and the weight mapping of
the sigmoid router's score-correction bias and the shared experts (`mapping.py`). The field
rows such families share: models.families.sigmoid_routed.

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
