"""The seam between megatron's GPTModel and a loss head that applies the output projection itself
(engine.training.loss_head: chunked over tokens, never holding [tokens, vocab/tp] logits).

Inside `returning_hidden_states(chunks)` the output layer of every last-stage chunk returns its
*input* prepared exactly as megatron's ColumnParallelLinear prepares it before its matmul,
instead of logits:
  - Megatron sequence parallelism: the [s/tp, b, h] hidden states are all-gathered along the
    sequence over TP (backward: reduce-scatter, i.e. the gradient is summed over TP ranks and
    each rank keeps its sequence slice);
  - otherwise: an identity whose backward all-reduces the gradient over TP.
GPTModel then returns them as [b, s, h] (its usual transpose), replicated over the TP group. The
head multiplies them with `output_weight(model)`: this TP rank's [V_padded/tp, h] vocab shard
(the input embedding with tied embeddings on a stage that holds it, else the output layer's
weight; megatron's own choice in GPTModel._postprocess). The gradient a head gives these hidden
states is this rank's partial sum over its vocab shard; the TP sum happens in the backward
above. Outside the context manager the model returns logits, unchanged (verification,
conversion, weight-sync checks).
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from parallel.wrappers import unwrap


def output_weight(chunk) -> torch.Tensor:
    """This TP rank's output-projection weight [V_padded/tp, h] of a last-stage chunk."""
    model = unwrap(chunk)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward: all-reduce (sum) of the gradient over the TP group.

    Megatron's copy_to_tensor_model_parallel_region all-reduces `grad.contiguous()` and returns
    `grad`, which loses the sum when the gradient arrives non-contiguous (here it does: GPTModel
    transposes [s, b, h] -> [b, s, h] after the output layer)."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_replicated_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` [s or s/tp, b, h] as ColumnParallelLinear `layer` feeds it to its matmul:
    SP-gathered along the sequence (backward reduce-scatter over TP) or TP-copied (backward
    all-reduce over TP). Identity forward and backward at tp == 1."""
    group = getattr(layer, "tp_group", None)
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                    group=group)
    group = group or ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return hidden
    return _CopyToTensorParallel.apply(hidden, group)


def _hidden_forward(layer, input_, weight=None, runtime_gather_output=None):
    """ColumnParallelLinear.forward's signature; returns (TP-replicated hidden states, None)."""
    if layer.bias is not None:
        raise NotImplementedError("the chunked loss head supports an output layer without "
                                  "bias only (GPTModel builds it without one)")
    return tp_replicated_input(layer, input_), None


@contextlib.contextmanager
def returning_hidden_states(chunks: list):
    """While active, last-stage chunks of `chunks` return [b, s, h] hidden states (module
    docstring) instead of [b, s, V/tp] logits. Restores the output layers on exit."""
    layers = [unwrap(c).output_layer for c in chunks if unwrap(c).post_process]
    for layer in layers:
        layer.forward = types.MethodType(_hidden_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's ColumnParallelLinear.forward again
