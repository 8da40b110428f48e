"""The global gradient norm and the clipping scale with one host sync per step.

Megatron-core 0.16 without Apex or Transformer Engine computes the L2 norm of the gradients with
its local stand-in for Apex's multi-tensor kernel (`megatron.core.utils.
local_multi_tensor_l2_norm`): it takes every gradient's norm, then builds a host tensor of them
(`torch.tensor(list of device scalars)`: one device-to-host copy per gradient tensor, hundreds
per step) and copies the result back to the device. Its stand-in for the scale kernel multiplies
and copies each gradient separately.

`l2_norm` computes the same numbers on the device: the same per-tensor `torch.norm`s, stacked
(the values `torch.tensor` would hold) and their norm, as the [1] float32 device tensor megatron
expects; megatron's `get_grad_norm_fp32` then all-reduces it and reads it once (`.item()`: the one
sync, per optimizer whose gradient-statistics group differs). `scale` multiplies a list of
gradients in place with one `torch._foreach_mul_` (the same products, bitwise).
`install()` puts both in place of megatron's local stand-ins in `megatron.core.optimizer.
clip_grads`; where Apex's or TE's kernels are in use it changes nothing (idempotent). Its entry
in models.build.megatron_patches (`grad_norm_one_sync`) gates it by megatron-core version and
probe.
"""
from __future__ import annotations

import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads

from models.build import megatron_patches

_MEGATRON_L2_NORM = megatron_utils.local_multi_tensor_l2_norm
_MEGATRON_SCALE = megatron_utils.local_multi_tensor_scale


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's `local_multi_tensor_l2_norm` (one tensor list, no per-tensor
    norms): ([1] float32 L2 norm of all tensors, on their device, None), same value."""
    tensors = tensor_lists[0] if len(tensor_lists) == 1 else None
    if (per_tensor or not tensors
            or len({(t.dtype, t.device) for t in tensors}) != 1):
        return _MEGATRON_L2_NORM(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    norms = torch.stack([torch.norm(t) for t in tensors])
    return torch.norm(norms).reshape(1).to(torch.float32), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """Drop-in for megatron's `local_multi_tensor_scale`: dst = src * factor; in place with one
    foreach call when each dst is its src (gradient clipping), else megatron's loop."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(s is d for s, d in zip(src, dst)):
        if dst:
            torch._foreach_mul_(dst, factor)
        return
    _MEGATRON_SCALE(chunk_size, noop_flag, tensor_lists, factor)


l2_norm.megatron_original = _MEGATRON_L2_NORM   # what models.build.megatron_probes checks
scale.megatron_original = _MEGATRON_SCALE


def install() -> None:
    """Use `l2_norm`/`scale` in megatron's gradient norm and clipping where it runs its local
    stand-ins (no Apex, no TE) and the registry lets it (`grad_norm_one_sync`); idempotent."""
    if not megatron_patches.gate("grad_norm_one_sync"):
        return
    if clip_grads.l2_norm_impl in (_MEGATRON_L2_NORM, l2_norm):
        clip_grads.l2_norm_impl = l2_norm
    if clip_grads.multi_tensor_scale_impl in (_MEGATRON_SCALE, scale):
        clip_grads.multi_tensor_scale_impl = scale
