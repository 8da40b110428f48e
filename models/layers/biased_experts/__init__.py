"""A router and experts with biases and the clamped SwiGLU (`spec.py`), and fused expert tensors
on disk seen as per-expert names (`fused.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
