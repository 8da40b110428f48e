"""Exact weight sync into an in-process vLLM engine (engine.generation.vllm.backend).

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

A model whose `load_weights` copies a tensor straight into the parameter instead of through its
weight loader (vLLM 0.32's gpt-oss does so for the attention sinks and the unquantized experts)
would write into the placeholder the reload put there, and finalising would restore the old
values: `load` catches those copies and loads their layers exactly
(engine.generation.vllm.direct_copies). What is still left is refused, never served: `close`
names any tensor copied past the reload that was not loaded that way.

`close` returns what the sync left unwritten: every parameter of vLLM's loading format
(`loading_format_names`) that `load_weights` did not report, every fused layer that got only
some of its shards (q_proj without k_proj, one expert missing), and every copy past the reload.
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

from engine.generation.vllm.direct_copies import DirectCopies


class LayerwiseSync:
    """One weight sync into `model` (vLLM's model, in this process) of an engine with
    `vllm_config`; `on_cpu`: apply the CPU repairs (module docstring). `model_config`: the
    model's own config when it is not the engine's (a speculative drafter,
    engine.generation.vllm.spec_sync), for finalising its attention layers."""

    def __init__(self, model: torch.nn.Module, vllm_config, on_cpu: bool,
                 model_config=None) -> None:
        self.model, self.vllm_config, self.on_cpu = model, vllm_config, on_cpu
        self.model_config = model_config or vllm_config.model_config
        self.loaded: set[str] = set()
        self.moe_kernels: dict = {}
        if on_cpu:  # finalising rebuilds the CPU MoE kernels (pad + prepack) when they are None
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if getattr(method, "moe_kernel", None) is not None:
                    self.moe_kernels[module] = method.moe_kernel
                    method.moe_kernel = None
        # what a sync must write: the loading format's parameters, each once (a tied head
        # shares the embedding's, which named_parameters lists once)
        self.expected = loading_format_names(model) & {n for n, _ in model.named_parameters()}
        initialize_layerwise_reload(model)
        self.direct_copies = DirectCopies(model)

    def load(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full tensors by HF name."""
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), self.direct_copies:
            loaded = self.model.load_weights(iter(bucket))
        self.loaded |= set(loaded or ())

    def close(self) -> list[str]:
        """Finalise the reload and repair (module docstring); the names left unwritten."""
        partial = [f"{name} ({info.load_numel}/{info.load_numel_total} values)"
                   for name, module in self.model.named_modules()
                   if (info := LAYERWISE_INFO.get(module)) is not None and info.can_load()
                   and not isinstance(module, VocabParallelEmbedding)
                   and 0 < info.load_numel < info.load_numel_total]
        bypassed = [f"{name} (copied past vLLM's reload)" for name in sorted(self.loaded)
                    if _waiting_for_loads(self.model, name)]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self.model, self.model_config)
            for module, kernel in self.moe_kernels.items():
                if module.quant_method.moe_kernel is None:  # a layer this sync did not reach
                    module.quant_method.moe_kernel = kernel
            head = getattr(self.model, "lm_head", None)
            embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
            if self.on_cpu and head is not None and embed is not None \
                    and head.weight.data_ptr() == embed.weight.data_ptr():
                head.quant_method.process_weights_after_loading(head)  # tied: repack the head
        return sorted(self.expected - self.loaded) + partial + bypassed


def _waiting_for_loads(model: torch.nn.Module, name: str) -> bool:
    """Whether the layer owning parameter `name`, which the model's `load_weights` reported
    loaded, still waits for its first load through the reload's weight loaders: the loader
    copied into the placeholder the reload had put there, and finalising puts the old kernel
    tensors back."""
    owner, _, _ = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    info = LAYERWISE_INFO.get(module)
    return info is not None and info.can_load() and info.load_numel == 0


def loading_format_names(model: torch.nn.Module) -> set[str]:
    """The names of the parameters vLLM's loader fills, as vLLM recorded them when it built the
    model (before any processing after loading): a sync must write each of them. Tensors that
    processing derives from them are not among them (MLA's W_UK_T and W_UV, computed from
    kv_b_proj when the attention layer is finalised)."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            if (info := LAYERWISE_INFO.get(module)) is not None
            for name in info.restore_metadata[0]}
