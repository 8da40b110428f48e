"""The vLLM backend (rollout.backend=vllm; `backend.py`: VLLMRolloutEngine): the engine in the
owner's process (`process.py`), requests and their log-prob contract (`requests.py`,
`scoring.py`, `adapter.py`), the worker extension (`worker.py`) and the weight sync
(`sync.py`, `weights.py`, `direct_copies.py`, `attention.py`), LoRA (`lora.py`), speculative
decoding (`speculative*.py`, `spec_*.py`) and the tested release (`version.py`); settings
`rollout.vllm.*` checked by `settings.py`.

Absolute imports: `import vllm` inside this package is vLLM itself, never this package;
the modules reach it through `library.vllm_module()` (imported at its first use).

May import: engine.generation (its backend-independent modules), engine.generation.sync,
engine.config.lora_settings, models.
"""
