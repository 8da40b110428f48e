"""torch.distributed on gloo the way megatron-core calls it on a GPU host (parallel.cpu_runtime's
CudaToCpuMode routes these calls here on a CPU host).

- `gather_on_one_rank`: a synchronous all-gather into one tensor over one rank, done on the
  calling thread instead of gloo's worker thread;
- `uneven_all_gather` / `uneven_reduce_scatter`: tensors of different first-dimension sizes
  (megatron's all-to-all MoE token dispatcher with TP), which gloo refuses;
- `split_sizes_as_lists`: all_to_all_single's split sizes given as tensors, as int lists.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def one_rank(output_tensor, input_tensor, group=None, async_op=False) -> bool:
    """A synchronous gather over a group of one rank (megatron's distributed optimizer
    gathers its parameter buckets after every step, over the DP group: one rank in a
    one-process run). Calls being traced by torch.compile (their group may be a name) and
    groups given other than as a ProcessGroup go to torch.distributed unchanged."""
    if async_op or torch.compiler.is_compiling():
        return False
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return False
    return dist.get_world_size(group) == 1


def gather_on_one_rank(output_tensor, input_tensor, group=None, async_op=False) -> None:
    """all_gather_into_tensor over one rank on the calling thread: the output is the input
    (megatron's bucket is its own shard: nothing to copy). Through gloo the copy ran on gloo's
    worker thread, where ATen's parallel copy started a second OpenMP team; with more OpenMP
    threads than cores libgomp stops spinning at its barriers (its throttled spin count), and
    every later parallel region of the main thread paid a futex wake-up: a 16 x 384 x 1,152
    matmul on 2 threads went from ~190 to ~450 us for the rest of the process
    (tests/test_cpu_runtime_gather.py)."""
    if output_tensor.data_ptr() != input_tensor.data_ptr() or \
            output_tensor.shape != input_tensor.shape:
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))


def uneven(tensors) -> bool:
    return isinstance(tensors, (list, tuple)) and len({tuple(t.shape) for t in tensors}) > 1


def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
    """all_gather into tensors of different first-dimension sizes (gloo requires equal
    ones; megatron's MoE all-to-all dispatcher gathers a different token count per TP rank):
    pad every input to the largest size, gather, keep each rank's real rows. Synchronous."""
    rows = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in tensor_list]
    dist.all_gather(parts, padded, group=group)
    for out, part in zip(tensor_list, parts):
        out.copy_(part[:out.shape[0]])
    return None


def uneven_reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    """reduce_scatter of inputs with different first-dimension sizes (sum only): all-reduce
    the concatenation, keep this rank's slice. Synchronous."""
    if op not in (None, dist.ReduceOp.SUM):
        raise NotImplementedError(f"uneven reduce_scatter with op {op} on the CPU host")
    whole = torch.cat([t.contiguous() for t in input_list], dim=0)
    dist.all_reduce(whole, group=group)
    rank = dist.get_rank(group)
    start = sum(t.shape[0] for t in input_list[:rank])
    output.copy_(whole[start:start + input_list[rank].shape[0]])
    return None


def split_sizes_as_lists(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """all_to_all_single's split sizes as int lists: megatron's all-to-all token dispatcher
    passes them as tensors, which it moves to host numpy arrays only when they are on a GPU;
    the process group binding accepts sequences of ints only."""
    def as_list(sizes):
        return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes

    args = tuple(as_list(a) if i in (2, 3) else a for i, a in enumerate(args))
    for key in ("output_split_sizes", "input_split_sizes"):
        if key in kwargs:
            kwargs[key] = as_list(kwargs[key])
    return args, kwargs
