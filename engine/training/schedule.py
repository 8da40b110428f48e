"""Run this rank's micro-batches of one global mini-batch through megatron's pipeline schedule.

`run_micro_batches` feeds this rank's micro-batches to `forward_backward_func` (1F1B, or
interleaved with virtual PP), with a loss function that returns the *weighted sum* of per-token
terms (engine.training.loss contract), and returns the report sums reduced to the global mini-batch:
summed over micro-batches on the last pipeline stage, then over the DP x CP group, then shared
with every PP stage. TP ranks hold identical values and are never summed.

Loss head: with `loss_chunk_tokens` (the default, train.loss_chunk_tokens) the last stage's
model returns hidden states (models.layers.heads.output) and the loss function receives an
engine.training.loss_head.HiddenStates instead of [b, s, V/tp] logits; the token_losses
functions compute the same log-probs/entropy from either, chunk by chunk over tokens. With
`loss_chunk_tokens=None` the loss function receives megatron's logits (unchunked).

Prefix sharing (a micro-batch with `tree`, engine.training.tree_batch): the model runs the tree
row and the loss and output functions receive its output gathered into the unshared rows.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS, HiddenStates
from engine.training.micro_batches import MicroBatch
from engine.training.mtp import MTPTraining, add_mtp_loss, begin_forward, end_forward
from engine.training.tree_batch import unshared_output
from models.build.compile_layers import has_compiled_layers
from models.layers.heads.output import output_weight, returning_hidden_states
from models.layers.unread_positions import kept_rows, skipping_layer, skipping_unread
from parallel import cpu_runtime
from parallel.wrappers import unwrap

# loss_fn(output [b, s, V/tp] logits or HiddenStates, micro_batch)
#   -> (loss_sum, {name: scalar sum tensor})
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _to_device(mb: MicroBatch, device) -> MicroBatch:
    for name in ("tokens", "labels", "token_weights", "loss_mask", "position_ids", "seq_ids"):
        setattr(mb, name, getattr(mb, name).to(device))
    mb.extras = {k: v.to(device) for k, v in mb.extras.items()}
    if mb.vision is not None:
        mb.vision = mb.vision.to(device)
    if mb.tree is not None:
        mb.tree.to(device)
    if mb.packed_seq_params is not None:
        p = mb.packed_seq_params
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                     "cu_seqlens_kv_padded"):
            setattr(p, name, getattr(p, name).to(device))
    return mb


def moe_padding_mask(model, mb: MicroBatch) -> dict:
    """{"padding_mask": [b, s] bool, True on padding} for every MoE model's routers; {} for
    dense models. Padding is a position of no sequence (seq_ids -1; a prefix tree's padding
    tail); a dummy micro-batch is all padding. Megatron-core's router then leaves padding out
    of the z-loss, the aux_loss / seq_aux_loss / global_aux_loss scores, expert counts and
    token counts, and the aux-loss-free bias update (expert_bias) counts, so padding gets no
    router-loss gradient and the router losses do not depend on how much padding a layout adds
    (engine.training.router_losses: its step token count and moe/* metrics skip it too; a
    dummy gets no per-micro-batch aux loss there). Megatron scatters the mask over TP only on
    the first pipeline stage; later stages with sequence parallelism get this TP rank's slice
    of the sequence here."""
    chunk = unwrap(model)
    if not chunk.config.num_moe_experts:
        return {}
    mask = mb.seq_ids < 0 if mb.tree is None else mb.tree.padding
    if mb.dummy:
        mask = torch.ones_like(mask)
    if chunk.config.sequence_parallel and not chunk.pre_process:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        width = mask.shape[1] // tp
        mask = mask[:, rank * width:(rank + 1) * width]
    return {"padding_mask": mask.contiguous()}


def _host_floats(values: list) -> list[float]:
    """float(v) of every value (tensors of one element, or numbers), reading each device's
    tensors with one copy instead of one device read per value (the same float64 numbers)."""
    out = [v if not torch.is_tensor(v) else None for v in values]
    by_device: dict = {}
    for j, v in enumerate(values):
        if torch.is_tensor(v):
            by_device.setdefault(v.device, []).append(j)
    for idx in by_device.values():
        host = torch.stack([values[j].detach().reshape(()).to(torch.float64) for j in idx])
        for j, x in zip(idx, host.cpu().tolist()):
            out[j] = x
    return [float(x) for x in out]


def reduce_reports(reports: list[dict[str, torch.Tensor]], keys: list[str]) -> dict[str, float]:
    """Sum report entries over micro-batches (last stage), DP x CP, then share over PP."""
    vec = torch.zeros(len(keys), dtype=torch.float64)
    entries = [(i, rep[k]) for rep in reports for i, k in enumerate(keys) if k in rep]
    for (i, _), value in zip(entries, _host_floats([v for _, v in entries])):
        vec[i] += value
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        vec.zero_()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(vec, group=group)
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(vec, group=pp_group)
    return {k: float(v) for k, v in zip(keys, vec)}


def _read_rows(mb: MicroBatch, cp: int) -> torch.Tensor | None:
    """The rows of the last layer's input that a loss reads (models.layers.unread_positions):
    the loss mask's positions; of a prefix tree's row, the tree nodes that the trained unshared
    tokens are gathered from (`tree.gather`, ascending). None (the full layer) for a tree at
    CP > 1, whose row is sharded in another order than the unshared tokens'."""
    if mb.tree is None:
        return kept_rows(mb.loss_mask)
    if cp > 1:
        return None
    return torch.unique(mb.tree.gather[mb.loss_mask.reshape(-1) > 0])


def run_micro_batches(chunks: list, micro_batches: list[MicroBatch], loss_fn: LossFn,
                      forward_only: bool = False,
                      output_fn: Callable[[torch.Tensor, MicroBatch], None] | None = None,
                      before_forward: Callable[[object, MicroBatch], None] | None = None,
                      loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
                      mtp: MTPTraining | None = None, vocab_size: int | None = None,
                      skip_unread: bool = False) -> list[dict[str, torch.Tensor]]:
    """Forward (and backward unless `forward_only`) of all micro-batches of this rank.

    All micro-batches must share one shape when pp > 1 (the caller pads them). `output_fn`,
    when given, sees each micro-batch's logits on the last stage (forward-only uses: recomputed
    log-probs). Both see a HiddenStates instead of logits when `loss_chunk_tokens` is set (the
    chunked loss head, module docstring). `mtp`: train the MTP layer too (engine.training.mtp:
    the micro-batches carry its targets; needs the chunked head and `vocab_size`).
    `skip_unread` (train.skip_unread_positions): the last layer's MLP runs only at the positions
    of each micro-batch's `loss_mask` (models.layers.unread_positions; of a prefix tree's row,
    the nodes they are gathered from, at CP 1 only). Not with compiled layers, nor where that
    module's `unsupported` names a reason, nor for a `loss_fn` whose attribute
    `reads_unmasked_positions` is true (ORPO's). `loss_fn` and `output_fn` must then read the
    output only there (elsewhere it is finite and not the
    model's). Returns the per-micro-batch report dicts of the last stage (empty elsewhere).
    """
    if mtp is not None and not loss_chunk_tokens:
        raise ValueError("the MTP loss runs on the chunked loss head: train.loss_chunk_tokens "
                         "must be > 0 with model.mtp.enabled=true")
    device = cpu_runtime.device()
    cp = ps.get_context_parallel_world_size()
    skip_layer = (skipping_layer(chunks) if skip_unread and not has_compiled_layers(chunks)
                  and not getattr(loss_fn, "reads_unmasked_positions", False) else None)
    # the rows it keeps (this rank's last stage only), found on the host copy: no device read
    kept = {id(mb): rows.to(device) for mb in micro_batches
            if skip_layer is not None and (rows := _read_rows(mb, cp)) is not None}
    batches = [_to_device(mb, device) for mb in micro_batches]
    shape = (batches[0].tokens if batches[0].tree is None else batches[0].tree.tokens).shape

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if before_forward is not None:  # e.g. MoE routing replay targets (engine.training.routing)
            before_forward(model, mb)
        vision = {} if mb.vision is None else {"vision": mb.vision}   # models.vision.model
        rows_of.set_rows(kept.get(id(mb)))
        if mtp is not None and unwrap(model).mtp_process:
            begin_forward(model, mb, mtp)
        tree = mb.tree   # prefix sharing: the model runs the tree (engine.training.tree_batch)
        output = model(*((mb.tokens, mb.position_ids) if tree is None else
                         (tree.tokens, tree.position_ids)), None,
                       packed_seq_params=mb.packed_seq_params if tree is None else tree.params,
                       **moe_padding_mask(model, mb), **vision)

        def loss_func(output_tensor):
            if loss_chunk_tokens:
                output_tensor = HiddenStates(output_tensor, output_weight(model),
                                             loss_chunk_tokens)
            output_tensor = unshared_output(output_tensor, mb.tree)   # the one gather
            if output_fn is not None:
                output_fn(output_tensor, mb)
            loss, report = loss_fn(output_tensor, mb)
            if mtp is not None and unwrap(model).mtp_process:
                loss = add_mtp_loss(model, mb, mtp, loss, report, vocab_size,
                                    loss_chunk_tokens)
                end_forward(model)
            report = {k: v.detach() for k, v in report.items()}
            return loss, torch.tensor(1, dtype=torch.int), report

        return output, loss_func

    vpp = len(chunks)
    iterators = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    packed = batches[0].packed_seq_params is not None
    seq_length = shape[1] * cp
    head = (returning_hidden_states(chunks) if loss_chunk_tokens else contextlib.nullcontext())
    with head, skipping_unread(skip_layer) as rows_of:
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=chunks if vpp > 1 else chunks[0], num_microbatches=len(batches),
            seq_length=seq_length, micro_batch_size=1 if packed else shape[0],
            forward_only=forward_only)
    return list(reports)
