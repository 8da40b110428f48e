"""Assembling Megatron models from HF configs.

`factory.py` builds the GPTModel chunks of this rank (layer specs chosen from the family's
declared layer kinds), `transformer_config.py` turns an HF config into Megatron's
TransformerConfig and GPTModel arguments, `forward.py` runs forward-only logits through any
layout (verification).

May import: models.vision, models.lora, models.estimate, models.layers, models.hf, models.families,
models.families.base, parallel.
"""
