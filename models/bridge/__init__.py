"""HF <-> Megatron weights and checkpoints: the top of models/.

`weights.py` maps every Megatron parameter of a rank's chunks to its HF tensors and back (load
with TP/EP sharding, export with gathers), through one table of layer kinds (`LAYER_KINDS`):
each kind's mapping lives in its package under models.layers. `checkpoint.py` saves and loads
Megatron distributed checkpoints with their HF metadata; `critic.py` is the PPO critic in HF
(token-classification) form.

May import: models.vision, models.build, models.lora, models.estimate, models.layers, models.hf,
models.families, models.families.base, models.formats, parallel.
"""
