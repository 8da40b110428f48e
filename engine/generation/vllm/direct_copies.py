"""Weights a vLLM model's loader copies past the layerwise reload, caught and loaded exactly
(engine.generation.vllm.sync).

vLLM's layerwise reload (vllm.model_executor.model_loader.reload) puts a meta-device
placeholder in place of every parameter of the loading format and wraps each parameter's
`weight_loader`: a layer is loaded, processed and copied into its kernel tensors once its
loaders have received all of its values. Some loaders skip the weight loader and `copy_`
straight into the parameter: vLLM 0.32's gpt-oss for the attention sinks and the unquantized
experts (`param.copy_(...)` in GptOssModel._load_weights_other). During a reload that copy goes
into the meta placeholder and is lost, and finalising puts the old values back (measured before
this module: log-prob errors 0.08 from the sinks, 1.4 from the experts after one sync).

`DirectCopies` is a torch function mode held around `load_weights`. It sees every `copy_` into
a whole placeholder made outside a weight loader (vLLM counts a loader's own copies under its
`CopyCounter` dispatch mode; those are the reload's business) and keeps the value, which is
already in the loading format (the loader narrowed and permuted it). When every parameter of a
layer that no weight loader touched has its value, the layer is processed as vLLM processes a
loaded layer (`_layerwise_process`: materialised, filled, its quantisation method's
`process_weights_after_loading` run, copied into the kernel tensors), so at most one layer's
values are held at a time. Copies into part of a placeholder, or into a layer some weight
loader also fed, are left alone: vllm.sync then reports them ("copied past vLLM's reload") and
the engine refuses to sample, never serving stale weights.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _layerwise_process
from vllm.model_executor.model_loader.reload.meta import CopyCounter, materialize_layer


class DirectCopies(TorchFunctionMode):
    """Held around `model.load_weights` during a layerwise reload of `model` (after
    `initialize_layerwise_reload`): loads the layers whose loader copies past the reload
    (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        # meta storage -> (layer, parameter name), for every placeholder waiting for loads
        self.placeholders: dict[int, tuple[torch.nn.Module, str]] = {
            p.untyped_storage()._cdata: (layer, name)
            for layer in model.modules()
            if (info := LAYERWISE_INFO.get(layer)) is not None and info.can_load()
            for name, p in layer.named_parameters(recurse=False) if p.is_meta}
        self.pending: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_ and args[0].is_meta and not _in_weight_loader():
            self._keep(args[0], args[1])
        return out

    def _keep(self, target: torch.Tensor, value: torch.Tensor) -> None:
        hit = self.placeholders.get(target.untyped_storage()._cdata)
        if hit is None:
            return
        layer, name = hit
        placeholder = getattr(layer, name)
        if target.shape != placeholder.shape or target.storage_offset() != 0:
            return   # part of a parameter: not handled here, vllm.sync reports it
        values = self.pending.setdefault(layer, {})
        values[name] = value.detach().to(placeholder.dtype, copy=True)
        info = LAYERWISE_INFO[layer]
        wanted = {n for n, p in layer.named_parameters(recurse=False) if p.is_meta}
        if info.load_numel == 0 and wanted <= set(values):
            del self.pending[layer]
            materialize_layer(layer, info)
            with torch.no_grad():
                for n, v in values.items():
                    getattr(layer, n).copy_(v)
            _layerwise_process(layer, info)   # nothing buffered: process, copy to the kernel


def _in_weight_loader() -> bool:
    """Whether vLLM is counting a wrapped weight loader's copies right now."""
    return any(isinstance(m, CopyCounter) for m in _get_current_dispatch_mode_stack())
