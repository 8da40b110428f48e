"""The --model folder (checked by engine.serve.folder) loaded on a rollout engine
(engine.generation): hf (transformers, CPU or GPU) or vllm (vllm.LLM in this process, vLLM
imported on first use; rollout.vllm's defaults with max_model_len = the endpoint's max
context, and the model compiled as vLLM's own server does unless --enforce-eager: rollout's CPU
default is eager, because RL restarts engines and a compile costs a start about 35 s on a
2-core host, while a server starts once and decodes about 3x faster per step compiled,
measured on that host: docs/benchmarks.md, "serve under load against vLLM's server"), and
on a CPU host vLLM's own thread binding (vllm.process.cpu_bind: a server's steps are short
and latency-bound; rollout binds the worker to every CPU for throughput).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.rollout_settings import RolloutConfig
from engine.generation.eos import folder_tokenizer
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.vllm.backend import VLLMRolloutEngine
from engine.serve.folder import checkpoint_dtype


@dataclass
class LoadedModel:
    """A loaded --model: its rollout engine and tokenizer."""

    engine: object           # an engine.generation.RolloutEngine
    tokenizer: object


def load_model(path: str, backend: str, dtype: str, seed: int, max_context: int,
               trust_remote_code: bool = False, enforce_eager: bool = False) -> LoadedModel:
    """`path` on the `backend` rollout engine (module docstring) in `dtype` (auto: the
    checkpoint's on both backends; vLLM is told it, engine.serve.folder.checkpoint_dtype,
    since its own auto serves a float32 folder in bfloat16); `enforce_eager` (vllm;
    --enforce-eager): vLLM runs the model eagerly instead of compiled. ValueError when it does
    not load (the message names --model)."""
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    try:
        tokenizer = folder_tokenizer(path, trust_remote_code)
        if backend == "hf":
            engine = HFRolloutEngine(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        else:
            settings = RolloutConfig(backend="vllm")
            settings.vllm.max_model_len = max_context
            settings.vllm.enforce_eager = enforce_eager
            # auto: the checkpoint's dtype, told to vLLM (its own auto downcasts float32)
            stored = torch_dtype or checkpoint_dtype(path) or "auto"
            engine = VLLMRolloutEngine.from_config(path, settings, stored, seed,
                                                   trust_remote_code=trust_remote_code,
                                                   bind_all_cpus=False)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {path!r} does not load on the {backend} backend: "
                         f"{type(e).__name__}: {e}") from e
    return LoadedModel(engine, tokenizer)
