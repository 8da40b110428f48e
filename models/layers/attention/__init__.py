"""Attention on torch SDPA for the local spec (`core.py`), attention sinks and sliding windows
(`sinks.py`), packed rows through torch's Flash-Attention varlen kernel on CUDA (`varlen.py`), and
RoPE computed by transformers' own functions (`rope.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
