"""Gated DeltaNet (linear attention) and the gated attention of the hybrids: the module
(`module.py`), the chunked gated delta rule (`rule.py`), the per-layer decoder spec
(`spec.py`), the weight mapping (`mapping.py`) and the costs (`costs.py`).

May import: models.layers, models.hf, models.families, models.families.base, parallel.
"""
