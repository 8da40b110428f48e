"""Packed rows' attention in one kernel call on CUDA: torch's Flash-Attention varlen kernel.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.9) attends every segment of a packed
("thd") row in one call: cumulative boundaries `cu_seq_q` / `cu_seq_k` (int32, on the tensors'
device), the longest segment `max_q` / `max_k` (Python ints), `window_size=(left, right)`
((-1, 0): causal; (W, 0): causal with keys i - W .. i, the engine's `window_left`),
`enable_gqa` (K/V with fewer heads than Q, each KV head serving Hq / Hkv consecutive query
heads, as SDPA's own `enable_gqa`: no K/V repeat) and `scale`. The core attention
(models.layers.attention.core) hands a packed row to it when `uses_varlen` says the kernel
covers it, and keeps its per-segment SDPA loop for everything else:

- learned attention sinks (gpt-oss `softmax_type="learnable"`): the kernel has no sink column;
- tensors not on a CUDA device, a torch build without the flash kernel, or a device below
  compute capability 8.0 (flash's minimum);
- dtypes the kernel refuses: only float16 and bfloat16 (fp32 keeps the loop);
- head dims it refuses: query, key and value of one head dim (MLA's narrower value heads keep
  the loop), a multiple of 8, at most 256; query heads a multiple of the KV heads.

`varlen_refusal(...)` names the first of these that applies (None: the kernel serves it);
`varlen_call(...)` builds the kernel's arguments from the host-known boundaries (pure: no
device read, so no host sync); `varlen_packed_attention(...)` runs it. Numbers: the same
attention as the loop up to floating-point order (bf16 rounding on a GPU;
`python -m tools.bench gpu --items varlen` compares the two on a card).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.varlen import varlen_attn

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)


@torch.compiler.assume_constant_result
def flash_capable(device_index: int) -> bool:
    """This torch build has the flash kernel and CUDA device `device_index` can run it.
    A constant for dynamo (evaluated once when a compiled layer is traced, no graph break)."""
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY)


def flash_device(device: torch.device) -> bool:
    """A CUDA device the varlen kernel runs on (tests patch this to accept another device)."""
    return device.type == "cuda" and flash_capable(
        device.index if device.index is not None else torch.cuda.current_device())


def varlen_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   has_sinks: bool) -> str | None:
    """Why the varlen kernel cannot serve these packed tensors (query [t, h, d], key/value
    [t, g, d'], K/V not repeated), or None when it can (module docstring: the list)."""
    if has_sinks:
        return "learned attention sinks"
    if not flash_device(query.device):
        return f"{query.device.type} tensors (the kernel needs CUDA, flash, sm80+)"
    if query.dtype not in KERNEL_DTYPES or key.dtype != query.dtype or \
            value.dtype != query.dtype:
        return f"dtype {query.dtype} (the kernel takes float16, bfloat16)"
    dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    head_dim = query.shape[-1]
    if len(dims) != 1 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head dims {sorted(dims)} (the kernel takes one dim, a multiple of 8, <= 256)"
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} KV heads"
    return None


def uses_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                has_sinks: bool) -> bool:
    """The dispatch predicate of packed attention: True when the varlen kernel serves it."""
    return varlen_refusal(query, key, value, has_sinks) is None


@dataclass(frozen=True)
class VarlenCall:
    """The arguments `varlen_attn(query, key, value, ...)` is given, besides the tensors."""
    cu_seq_q: torch.Tensor      # [n + 1] int32 on the query's device
    cu_seq_k: torch.Tensor      # the same tensor (self-attention)
    max_q: int                  # the longest segment, from the host boundaries
    max_k: int
    scale: float
    window_size: tuple[int, int]
    enable_gqa: bool

    def kwargs(self) -> dict:
        return dict(scale=self.scale, window_size=self.window_size, enable_gqa=self.enable_gqa)


def device_bounds(bounds: list[int], device: torch.device) -> torch.Tensor:
    """`bounds` as an int32 tensor on `device`; to CUDA through pinned memory, asynchronously
    (a plain copy from pageable memory would wait for the device)."""
    host = torch.tensor(bounds, dtype=torch.int32)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def varlen_call(query: torch.Tensor, key: torch.Tensor, bounds: list[int], scale: float,
                window_left: int | None, cu_seqlens: torch.Tensor | None = None) -> VarlenCall:
    """The kernel's arguments for a packed row whose segments span bounds[i]:bounds[i+1]
    (host ints, bounds[-1] <= t). `cu_seqlens`: the same boundaries as a tensor when the
    caller has one (megatron's PackedSeqParams.cu_seqlens_q, moved to the device with the
    micro-batch); used as is when it is int32 on the query's device with len(bounds) entries,
    else the boundaries are copied there. `window_left`: query i sees keys i - window_left .. i
    (None: all earlier keys of its segment)."""
    reuse = (cu_seqlens is not None and cu_seqlens.dtype == torch.int32
             and cu_seqlens.device == query.device and cu_seqlens.numel() == len(bounds))
    cu = cu_seqlens if reuse else device_bounds(bounds, query.device)
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    window = (-1, 0) if window_left is None else (int(window_left), 0)
    return VarlenCall(cu, cu, longest, longest, float(scale), window,
                      bool(key.shape[1] != query.shape[1]))


@torch.compiler.disable  # its host boundaries and lengths would be guarded per packing in a
# compiled layer (a re-trace for every new packing); one kernel call, eager, as the loop
def varlen_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            bounds: list[int], scale: float, window_left: int | None,
                            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally windowed) attention of every segment of a packed row in one
    varlen_attn call: query [t, h, d], key/value [t, g, d] with h % g == 0 (not repeated)
    -> [t, h, d]. Only where `uses_varlen` holds; arguments as `varlen_call`."""
    call = varlen_call(query, key, bounds, scale, window_left, cu_seqlens)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    return varlen_attn(q, k, v, call.cu_seq_q, call.cu_seq_k, call.max_q, call.max_k,
                       **call.kwargs())
