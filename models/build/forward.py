"""Forward-only logits, and a value/score head's values, through any TP/PP/VPP layout
(verification and parity tests)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from models.layers.heads.output import returning_hidden_states
from models.layers.heads.value import value_head
from models.lora.modes import dropout_disabled
from parallel import cpu_runtime


def forward_logits(chunks: list, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab_size] for `tokens` [b, s], returned on every rank.

    Collective over the whole world: runs megatron's schedule forward-only, gathers the
    vocab-parallel logits over TP on the last stage and broadcasts them from there.
    Requires cp == 1 (verification runs unsharded sequences). With Megatron sequence
    parallelism the tokens are padded at the end to a multiple of tp (megatron splits the
    sequence over TP ranks); causal attention keeps the real positions' logits unchanged and
    the padded ones are dropped."""
    b, real = tokens.shape
    local = _forward_only(chunks, tokens)
    logits = torch.empty(b, real, vocab_size, dtype=torch.float32, device=cpu_runtime.device())
    if local is not None:
        local = local.float()
        parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits.copy_(torch.cat(parts, dim=-1)[:, :real, :vocab_size])
    return _from_last_stage(logits)


def forward_values(chunks: list, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [b, s] values of the value/score head (models.layers.heads.value) on the final
    hidden states of `tokens` [b, s], returned on every rank: v[i, t] = w . h[i, t] (+ b).
    A reward model's score of sequence i is v[i, len_i - 1]. Collective over the whole world,
    as forward_logits (cp == 1; sequence-parallel padding dropped)."""
    b, real = tokens.shape
    with returning_hidden_states(chunks):
        hidden = _forward_only(chunks, tokens)
    values = torch.empty(b, real, dtype=torch.float32, device=cpu_runtime.device())
    if hidden is not None:
        with torch.no_grad():
            values.copy_(value_head(chunks)(hidden)[:, :real])
    return _from_last_stage(values)


def _forward_only(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """The last stage's output [b, s', ...] for `tokens` [b, s] (s' = s, or s padded to a
    multiple of tp under sequence parallelism), None on other stages."""
    dev = cpu_runtime.device()
    tokens = tokens.to(dev)
    b, real = tokens.shape
    tp = ps.get_tensor_model_parallel_world_size()
    s = -(-real // tp) * tp if chunks[0].config.sequence_parallel else real
    if s > real:
        tokens = torch.cat([tokens, tokens.new_zeros(b, s - real)], dim=1)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1)

    def loss_func(output):
        return output.sum() * 0.0, torch.tensor(1), {"logits": output.detach()}

    def forward_step(data_iterator, model):
        next(data_iterator)
        return model(tokens, positions, None), loss_func

    vpp = len(chunks)
    # the interleaved schedule needs at least pp micro-batches: repeat the same one
    num_mb = ps.get_pipeline_model_parallel_world_size() if vpp > 1 else 1
    iters = ([iter([None] * num_mb) for _ in range(vpp)] if vpp > 1 else iter([None]))
    with torch.no_grad(), dropout_disabled(chunks):   # no LoRA dropout: a forward-only pass
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters,
            model=chunks if vpp > 1 else chunks[0], num_microbatches=num_mb, seq_length=s,
            micro_batch_size=b, forward_only=True)
    return out[0]["logits"] if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def _from_last_stage(result: torch.Tensor) -> torch.Tensor:
    """`result` as the last pipeline stage holds it, on every rank (a broadcast over PP)."""
    dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return result
