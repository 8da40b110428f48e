"""The generation engines (docs/design/rl.md, docs/rollout-backends.md): generate responses with
log-probs, score given sequences, receive a trainer's weights by HF name in buckets, sleep/wake
when colocated with training. RL's rollout (engine.rl), `serve` (engine.serve), the agent
endpoint and the LLM judges all run on them, so they sit one floor below both.

Layout: the backend-independent parts at this level (`base.py`: the RolloutEngine contract and
the backend registry; `sampling.py`: seeded per-row sampling; `scoring.py`: prompt log-probs;
`sampling_backend.py`: the OpenAI servers' batched generate protocol (engine.api.backend) over
an engine; `eos.py`: the folder's tokenizer and end-of-turn ids; `work_split.py`, `placement.py`,
`pool.py`: per-response seeds, engine placement and the pool of engines; `engine_memory.py`: what
the engines' weights weigh in `--validate`), then one sub-package per backend and one for the
weight-sync transport:

    hf/       transformers, CPU or GPU (the embedded default): backend, static-cache decode,
              length buckets, images, MoE routing reports, sync targets, its settings
    vllm/     vLLM's engine in the owner's process and its worker extension: backend, process,
              requests, scoring, weights and sync, LoRA, speculative decoding, version checks
    sglang/   SGLang's offline engine (GPU): backend, its pair requests, settings
    sync/     how buckets reach an engine's workers: shared-tensor handles, /dev/shm files,
              the buffers' lifetime, FP8 quantization of the sync

The backends import this level and `sync/`, never each other.

May import: engine.errors, engine.api.backend (the protocol SamplingBackend serves), models,
engine.config.lora_settings (the LoRA spec of model.lora.*, for rollout.vllm.lora_sync:
`vllm/lora.py`). Never engine.rl, engine.serve or any training package (tests/test_structure.py).
"""
from engine.generation.base import (BACKENDS, Generation, RolloutEngine, SamplingParams,
                                    backend_class, make_rollout_engine)

__all__ = ["BACKENDS", "Generation", "RolloutEngine", "SamplingParams", "backend_class",
           "make_rollout_engine"]
