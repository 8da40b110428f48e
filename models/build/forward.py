"""Forward-only logits through any TP/PP/VPP layout (verification and parity tests)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from parallel import cpu_runtime


def forward_logits(chunks: list, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab_size] for `tokens` [b, s], returned on every rank.

    Collective over the whole world: runs megatron's schedule forward-only, gathers the
    vocab-parallel logits over TP on the last stage and broadcasts them from there.
    Requires cp == 1 (verification runs unsharded sequences). With Megatron sequence
    parallelism the tokens are padded at the end to a multiple of tp (megatron splits the
    sequence over TP ranks); causal attention keeps the real positions' logits unchanged and
    the padded ones are dropped."""
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
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters,
            model=chunks if vpp > 1 else chunks[0], num_microbatches=num_mb, seq_length=s,
            micro_batch_size=b, forward_only=True)
    logits = torch.empty(b, real, vocab_size, dtype=torch.float32, device=dev)
    is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if is_last:
        local = out[0]["logits"].float()
        parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits.copy_(torch.cat(parts, dim=-1)[:, :real, :vocab_size])
    last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(logits, src=last_stage_rank, group=ps.get_pipeline_model_parallel_group())
    return logits
