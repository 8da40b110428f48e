"""The seam to a loss head that applies the output projection itself (`output.py`) and a PPO
critic's value head (`value.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
