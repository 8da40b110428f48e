"""The SGLang backend (rollout.backend=sglang, GPU; `backend.py`: SGLangRolloutEngine), its
paired requests (`pairs.py`) and its arguments and refusals for the tested release
(`settings.py`).

May import: engine.generation (its backend-independent modules), engine.generation.sync, models.
"""
