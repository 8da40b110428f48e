"""How weight-sync buckets reach a colocated engine's workers (rollout.sync_transport):
shared-tensor handles (`handles.py`, the default), safetensors files on /dev/shm
(`bucket_files.py`), the buffers' lifetime as one state machine (`lifetime.py`) and the FP8
quantization of the synced weights (rollout.sync_quantization: `quantization.py`).

May import: engine.generation (its backend-independent modules), models; no backend package.
"""
