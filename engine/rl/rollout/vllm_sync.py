"""Exact weight sync into an in-process vLLM engine (engine.rl.rollout.vllm_backend).

A sync is a run of `load` calls, one per bucket of full HF-named tensors (a bucket may split a
layer), between `open` and `close`. It goes through vLLM's layerwise reload and the model's own
`load_weights` (HF names; vLLM fuses q/k/v, gate/up and the experts itself), and `close` repairs
what vLLM 0.32's reload leaves stale on CPU, measured on tiny checkpoints:

- fused-MoE layers: the reload copies unpacked weights into the CPU grouped GEMM's packed
  buffers (wrong logits when the shapes agree, a size mismatch when the intermediate size is
  padded); `open` drops every MoE layer's kernel so that finalising rebuilds it (pad + prepack,
  as at first load);
- tied embeddings: the output head's packed GEMM weight keeps the old embedding (log-prob error
  0.6 after one update); `close` repacks it from embed_tokens;
- the prefix cache holds KV computed with the old weights; `close` resets it.

`close` returns what the sync left unwritten: every parameter `load_weights` did not report and
every fused layer that got only some of its shards (q_proj without k_proj, one expert missing).
A non-empty answer means stale weights; the engine refuses to generate with them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.reload.layerwise import (LAYERWISE_INFO,
                                                               finalize_layerwise_reload,
                                                               initialize_layerwise_reload)


class LayerwiseSync:
    """One weight sync into `model` (vLLM's model, in this process) of an engine with
    `vllm_config`; `on_cpu`: apply the CPU repairs (module docstring)."""

    def __init__(self, model: torch.nn.Module, vllm_config, on_cpu: bool) -> None:
        self.model, self.vllm_config, self.on_cpu = model, vllm_config, on_cpu
        self.loaded: set[str] = set()
        self.moe_kernels: dict = {}
        if on_cpu:  # finalising rebuilds the CPU MoE kernels (pad + prepack) when they are None
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if getattr(method, "moe_kernel", None) is not None:
                    self.moe_kernels[module] = method.moe_kernel
                    method.moe_kernel = None
        initialize_layerwise_reload(model)

    def load(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full tensors by HF name."""
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self.model.load_weights(iter(bucket))
        self.loaded |= set(loaded or ())

    def close(self) -> list[str]:
        """Finalise the reload and repair (module docstring); the names left unwritten."""
        partial = [f"{name} ({info.load_numel}/{info.load_numel_total} values)"
                   for name, module in self.model.named_modules()
                   if (info := LAYERWISE_INFO.get(module)) is not None and info.can_load()
                   and not isinstance(module, VocabParallelEmbedding)
                   and 0 < info.load_numel < info.load_numel_total]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self.model, self.vllm_config.model_config)
            for module, kernel in self.moe_kernels.items():
                if module.quant_method.moe_kernel is None:  # a layer this sync did not reach
                    module.quant_method.moe_kernel = kernel
            head = getattr(self.model, "lm_head", None)
            embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
            if self.on_cpu and head is not None and embed is not None \
                    and head.weight.data_ptr() == embed.weight.data_ptr():
                head.quant_method.process_weights_after_loading(head)  # tied: repack the head
        expected = {name for name, _ in self.model.named_parameters()}
        return sorted(expected - self.loaded) + partial
