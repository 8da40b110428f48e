"""Multi-latent attention: the megatron module made exact to HF (`module.py`), its weight mapping
(`mapping.py`) and its costs (`costs.py`: parameters, kept activations, TP and CP bytes, FP8
shapes).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
