"""The Tinker service's sampling on vLLM's multi-LoRA (`--sampler vllm`): the engine's vllm
generation backend (engine.generation.vllm.backend.VLLMRolloutEngine, with its log-prob
contract and per-row seeds) loads the base model once with vLLM's LoRA on, and every sampling
session's adapter is a LoRARequest of its own, so vLLM batches the sessions' requests and keeps
up to `max_loras` adapters on the device at once (more in host memory, the rest reloaded from
their folders as needed).

A sampler's adapter ({path.A / path.B: full HF tensor}, engine.tinker.adapters) is written once
as a peft folder (models.lora.peft.write_peft_adapter: rank, alpha 32, its targets, lm_head
included) under `folder`, and kept there while the server runs (vLLM reloads an evicted adapter
from it). A sample request is engine.tinker.sampler.sample_on this engine, as on the hf
sampler: the same reading of Tinker's SamplingParams and stop strings; the prompt's log-probs
are vLLM's prompt log-probs under the same adapter (the engine's `score`).

Served where vLLM's LoRA is (engine.generation.vllm.lora): the dense GQA families (Llama,
Qwen2, Qwen3); other models are refused at start (`problem`), and a rank above
`max_lora_rank` when the model is created (engine.tinker.routes)."""
from __future__ import annotations

import contextlib
import itertools
import shutil
from pathlib import Path

import torch
from vllm.lora.request import LoRARequest

from engine.config.rollout_settings import VLLMConfig
from engine.generation.vllm.backend import VLLMRolloutEngine
from engine.generation.vllm.settings import engine_args
from engine.tinker.lora import LORA_ALPHA, LoraSpec
from engine.tinker.sampler import sample_on
from models.lora.peft import write_peft_adapter
from models.lora.slices import LoraSpec as PeftSpec

PEFT_PREFIX = "base_model.model."


def peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{path.A / path.B: tensor} in peft's names ({PEFT_PREFIX}path.lora_A.weight, ...)."""
    return {f"{PEFT_PREFIX}{key[:-2]}.lora_{key[-1]}.weight": t.detach().float().cpu()
            for key, t in tensors.items()}


class TenantEngine(VLLMRolloutEngine):
    """A vLLM engine whose calls carry the LoRARequest `serving` (None: the base model)."""

    serving = None

    def lora_request(self):
        return self.serving


class VllmSampler:
    """Samplers' adapters as vLLM LoRARequests (module docstring). `decode(token ids) -> str`:
    the tokenizer's, for stop strings."""

    def __init__(self, model_dir: str, decode, folder: str, max_loras: int,
                 max_lora_rank: int, gpu_memory_utilization: float = 0.5):
        self.model_dir, self.decode, self.folder = model_dir, decode, Path(folder)
        self.max_rank = max_lora_rank
        on_cpu = not torch.cuda.is_available()
        kwargs = engine_args(VLLMConfig(gpu_memory_utilization=gpu_memory_utilization), 1,
                             on_cpu)
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras,
                      max_cpu_loras=4 * max_loras)
        self.engine = TenantEngine(model_dir, dtype="float32", seed=0, **kwargs)
        self.requests: dict[str, object] = {}
        self.ids = itertools.count(1)

    def load(self, adapter: str, spec: LoraSpec, tensors: dict) -> None:
        """Sampler adapter `adapter`: `tensors` written as a peft folder, served as a new
        LoRARequest."""
        if spec.rank > self.max_rank:
            raise ValueError(f"a rank-{spec.rank} adapter is above {self.max_rank}, the largest "
                             "this server's vLLM sampler serves (--sampler-max-lora-rank)")
        folder = self.folder / adapter
        write_peft_adapter(peft_tensors(tensors), PeftSpec(
            rank=spec.rank, alpha=LORA_ALPHA, targets=frozenset(spec.suffixes())),
            self.model_dir, folder)
        self.requests[adapter] = LoRARequest(adapter, next(self.ids), str(folder))

    def unload(self, adapter: str) -> None:
        """Drop sampler adapter `adapter`: out of vLLM's LoRA caches, its folder deleted."""
        request = self.requests.pop(adapter)
        self.engine.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def sample(self, requests: list[dict]) -> list[tuple[list, list | None]]:
        """engine.tinker.sampler.sample_on vLLM, one call per adapter of `requests` (each
        call serves one LoRARequest), the results in the requests' order."""
        out: list = [None] * len(requests)
        for adapter in dict.fromkeys(r["adapter"] for r in requests):
            mine = [k for k, r in enumerate(requests) if r["adapter"] == adapter]
            for k, result in zip(mine, sample_on(self.engine, [requests[k] for k in mine],
                                                 self.decode, self.rows_of)):
                out[k] = result
        return out

    @contextlib.contextmanager
    def rows_of(self, names: list[str | None]):
        """Every row runs adapter names[0] (`sample` calls with one adapter)."""
        self.engine.serving = self.requests[names[0]] if names and names[0] else None
        try:
            yield
        finally:
            self.engine.serving = None

    def shutdown(self) -> None:
        """Stop vLLM's processes (the command calls it once its server is down)."""
        self.engine.shutdown()
