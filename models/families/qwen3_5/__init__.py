"""Qwen3.5 / Qwen3.6, dense and MoE, and their conditional-generation checkpoints: the family
declarations (`family.py`), their config-field rows and wrapper entries (`fields.py`) and the
published shapes (`presets.py`). The Gated DeltaNet and gated attention layers they declare are
models.layers.gated_delta_net.

May import: models.families (base, fields, moe).
"""
