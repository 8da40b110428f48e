"""Norms for the local spec that support Megatron sequence parallelism (`local.py`) and the zero-
centred and gated RMSNorms (`zero_centered.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
