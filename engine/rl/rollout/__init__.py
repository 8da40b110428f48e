"""Rollout engines for RL (docs/design/rl.md): generate responses with log-probs, receive the
trainer's weights by HF name in buckets, sleep/wake when colocated with training.

Backends: "hf" (transformers, CPU or GPU; `hf_backend.py`) and "sglang" (GPU; `sglang_backend.py`).
What the weight sync sends them (rollout.sync_quantization: `sync_quantization.py`) and what
their weights weigh in `--validate` (`engine_memory.py`). `sampling_backend.py` serves the
OpenAI servers' batched generate protocol (engine.api.backend) with an engine's `generate`.

May import: engine.errors, engine.api.backend (the protocol SamplingBackend serves), models,
engine.config.lora_settings (the LoRA spec of model.lora.*, for rollout.vllm.lora_sync:
`vllm_lora.py`); nothing else of engine.rl.
"""
from engine.rl.rollout.base import (BACKENDS, Generation, RolloutEngine, SamplingParams,
                                    backend_class, make_rollout_engine)

__all__ = ["BACKENDS", "Generation", "RolloutEngine", "SamplingParams", "backend_class",
           "make_rollout_engine"]
