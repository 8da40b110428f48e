"""The transformers backend (rollout.backend=hf; `backend.py`: HFRolloutEngine): eager decode
loop, the static-cache and compiled decode (`static_decode.py`, `length_buckets.py`; settings
`rollout.hf.*` checked by `settings.py`), images (`images.py`), MoE routing reports
(`routing.py`) and the weight-sync targets (`targets.py`).

May import: engine.generation (its backend-independent modules), engine.generation.sync, models.
"""
