"""The last transformer layer's MLP only at the positions a loss reads (`skipping_unread`).

A causal LM's loss reads the final hidden state of the positions that predict a trained token
(a micro-batch's `loss_mask`); no later position attends to the last layer's outputs, so its
MLP at every other position (a prompt, padding, a masked tool output) only makes numbers
nobody reads. GRPO's rows are mostly prompt (a 350-token prompt and 32-token replies: the MLP
of one layer in four, 90% of its rows), as are DPO's and SFT's to a lesser degree.

Inside `skipping_unread(skipping_layer(chunks))` the last decoder layer of this rank's
last-stage chunk runs megatron's own `_forward_mlp` (pre-MLP norm, MLP, bias-dropout-add: the
same modules, LoRA adapters included) on the kept rows gathered into a [n, 1, h] tensor; the
result is written back into a copy of the layer's [s, b, h] input (`index_copy`, out of place:
autograd sends the kept rows' gradient through the MLP and the others' straight to the
residual). At every other position the layer returns its attention block's output (the
residual stream before the MLP): finite, and not the model's hidden state there; a consumer
must read only kept positions (the contract of engine.training.schedule.run_micro_batches).
Attention, its projections and the layers below still run everywhere (the kept positions
attend to all). `set_rows(keep)` before each micro-batch's forward names them: flat indices
t * b + row into the layer's [s, b, h] input (`kept_rows(loss_mask)`).

`unsupported(chunks)` names why a model cannot skip (then `skipping_layer` is None, the
context manager changes nothing and the full layer runs): Megatron sequence parallelism (the
layer's rows are split over TP ranks, whose MLP gathers them), an MoE last layer (its router's
load-balancing loss counts every token), a value head or an MTP layer (both read the final
hidden state of positions no token loss names), a last layer without megatron's
`_forward_mlp`. The caller also leaves compiled layers (train.compile: a gathered [n, 1, h]
input would compile graphs of its own; engine.training.schedule) and a prefix tree's row at
CP > 1.
"""
from __future__ import annotations

import contextlib
import types

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from parallel.wrappers import unwrap


def _last_layer(chunks: list):
    """The last decoder layer of this rank's last-stage chunk, or None (not the last stage,
    or a stage without decoder layers)."""
    models = [unwrap(c) for c in chunks if unwrap(c).post_process]
    if not models:
        return None
    decoder = getattr(models[-1], "decoder", None)
    layers = getattr(decoder, "layers", None)
    return layers[-1] if layers is not None and len(layers) else None


def unsupported(chunks: list) -> str | None:
    """Why the last layer of `chunks` cannot skip unread positions (module docstring), None
    when it can (or when this rank holds no last stage: nothing to skip)."""
    model = unwrap(chunks[-1])
    if model.config.sequence_parallel:
        return "Megatron sequence parallelism"
    if getattr(model, "value_head", None) is not None:
        return "a value head"
    if getattr(model, "mtp_process", False):
        return "an MTP layer"
    layer = _last_layer(chunks)
    if layer is None:
        return None
    if not isinstance(layer, TransformerLayer) or not hasattr(layer, "_forward_mlp"):
        return f"a last layer of type {type(layer).__name__}"
    if layer.is_moe_layer:
        return "an MoE last layer"
    return None


def kept_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Flat indices t * b + row of the positions with loss_mask > 0, for a micro-batch's
    `loss_mask` [b, s] (a packed row: [1, t]); int64 on loss_mask's device."""
    return (loss_mask.t().reshape(-1) > 0).nonzero().squeeze(1)


def _skipping_forward_mlp(layer, hidden_states, inference_context=None, padding_mask=None,
                          **_):
    """TransformerLayer._forward_mlp's signature (0.16: + padding_mask; 0.19: + packed_seq_params):
    megatron's own on the rows `layer`'s `_kept_rows` names, the rest of `hidden_states`
    [s, b, h] passed through. The padding mask and packed-sequence parameters only serve an
    MoE layer's routing (which never skips: `unsupported`) and describe the whole row, not the
    gathered one: they are not passed on."""
    keep = layer._kept_rows
    s, b, h = hidden_states.shape
    flat = hidden_states.reshape(s * b, h)
    kept = flat.index_select(0, keep).unsqueeze(1)
    out = type(layer)._forward_mlp(layer, kept, inference_context)
    merged = flat.index_copy(0, keep, out.squeeze(1)).view(s, b, h)
    return make_viewless_tensor(inp=merged, requires_grad=merged.requires_grad, keep_graph=True)


def skipping_layer(chunks: list):
    """The layer that skips unread positions on this rank: the last decoder layer of its
    last-stage chunk where `unsupported` names no reason; None elsewhere (another stage, or a
    model that runs the full layer)."""
    return _last_layer(chunks) if unsupported(chunks) is None else None


class Skipping:
    """The handle `skipping_unread` yields: `set_rows(keep)` names the kept rows of the next
    forward (None: every row, the layer as megatron runs it)."""

    def __init__(self, layer):
        self.layer = layer

    def set_rows(self, keep: torch.Tensor | None) -> None:
        if self.layer is None:
            return
        if keep is None:
            self.layer.__dict__.pop("_forward_mlp", None)
            return
        self.layer._kept_rows = keep
        self.layer._forward_mlp = types.MethodType(_skipping_forward_mlp, self.layer)


@contextlib.contextmanager
def skipping_unread(layer):
    """While active, `layer` (`skipping_layer`'s; None: nothing changes) skips the MLP at rows
    outside each forward's `set_rows` (module docstring). Yields a `Skipping`. Restores
    megatron's `_forward_mlp` on exit."""
    try:
        yield Skipping(layer)
    finally:
        if layer is not None:
            layer.__dict__.pop("_forward_mlp", None)
            layer.__dict__.pop("_kept_rows", None)
