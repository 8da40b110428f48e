"""Routed experts: one grouped computation per layer (`grouped.py`), the per-expert weight mapping
(`mapping.py`), megatron MoE on a host without Transformer Engine (`compat.py`) and routing
replay R2/R3 (`replay.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
