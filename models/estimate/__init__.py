"""Estimates for a parallel layout, before any process starts (`--validate`): parameters per
pipeline stage and TP rank (`counting.py`, LoRA adapters: `lora.py`, `lora_memory.py`), the
memory peak per GPU (`training_memory.py`, with the activation and logits terms of
`memory.py`), the vision tower of a model that takes images (`vision.py`) and bytes per
collective (`comm.py`). Plain arithmetic on an HF config
(dict or transformers object): no torch, megatron or transformers.

These modules hold the sums over a layout; the per-layer formulas of a layer kind that GQA's
would get wrong live beside that kind (models.layers.<kind>.costs) and are chosen by the kind a
family declares (`Family.mixer_of`, `multi_latent_attention`, ...), never by model_type.

May import: models.layers (cost formulas), models.families, models.families.base, models.lora
(the plain target names of models.lora.targets).
"""
