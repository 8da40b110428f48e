"""Weight gradients accumulated in float32, straight into megatron DDP's `main_grad`.

Without this, a bf16 model's linear computes each micro-batch's weight gradient as a bf16 GEMM
output (rounded to bf16), autograd stores it in `param.grad` and DDP's hook adds it to the fp32
`main_grad` buffer: one bf16 rounding per parameter per micro-batch, so the accumulated
gradient depends on how the global batch is cut into micro-batches. Megatron-core removes the
rounding with `gradient_accumulation_fusion`: its linears
(`LinearWithGradAccumulationAndAsyncCommunication`, TP and sequence-parallel paths alike) call
Apex's `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)`
(main_grad += grad_output^T @ input, fp32 output) and hand autograd a dummy gradient, marking
`param.grad_added_to_main_grad` so DDP's hook ignores it. Apex is not on the package registry
(docs/design/architecture.md), so `install()` registers the torch stand-in below under that
module name, where megatron looks for it (`megatron.core.tensor_parallel.layers`,
`megatron.core.utils`); a real Apex, when importable, is kept.

`enable(chunks)` switches the fusion on for every megatron Column/RowParallelLinear of the
chunks (their `gradient_accumulation_fusion` attribute, read at each forward, and the shared
TransformerConfig's field). Call it only for chunks that megatron DDP wraps: the fused backward
needs `param.main_grad` (megatron raises in the backward without it), which only DDP creates.
Frozen weights (LoRA's base) keep megatron's frozen-weight path; Transformer Engine's layers
read the config field when they are built (not this module's business); the project's grouped
experts (models.layers.experts.grouped: `torch.stack` of the expert weights) and LoRA adapters
(models.lora.adapters: `F.linear`) still get their weight gradients through `param.grad` and
DDP's hook, rounded per micro-batch in bf16. The chunked loss head
(engine.training.loss_head) follows the same protocol for the output weight with
`accumulates_into_main_grad`, `accumulate_matmul_fp32_` and `main_grad_autograd_result`.

Numbers, by the dtypes megatron hands the stand-in:
- bf16/fp16 inputs, fp32 main_grad (the engine's default, parallel.grad_reduce_in_fp32):
  main_grad += grad_output^T @ input as a GEMM with fp32 output (torch's `out_dtype` where this
  device implements it, probed once per device type and dtype with an example a bf16 output
  would round; else the inputs upcast to fp32: exact products, fp32 sums): no bf16 rounding of
  any micro-batch's weight gradient;
- fp32 inputs (fp32 runs): `main_grad.add_(grad_output^T @ input)`, the same two operations as
  the unfused path (GEMM, then DDP's hook adding param.grad): bitwise equal to it;
- bf16/fp16 main_grad (grad_reduce_in_fp32=false): main_grad.addmm_ (one rounding of the sum,
  where the unfused path rounds the product and then the sum).
"""
from __future__ import annotations

import sys
import types
import warnings

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers

from models.build import megatron_patches

__all__ = ["accumulate_matmul_fp32_", "accumulates_into_main_grad", "enable", "gemm_operand",
           "install", "main_grad_autograd_result", "matmul_fp32"]

APEX_MODULE = "fused_weight_gradient_mlp_cuda"

# (device type, input dtype) -> "addmm" (torch.addmm(..., out_dtype=float32, out=c) in place),
# "mm" (torch.mm(..., out_dtype=float32), then add) or "upcast" (fp32 copies of the inputs)
_FP32_OUTPUT_KIND: dict[tuple[str, torch.dtype], str] = {}


def _fp32_output_kind(device: torch.device, dtype: torch.dtype) -> str:
    """How this device computes a GEMM of `dtype` inputs with float32 output (probed once):
    1 + 2^-9 is exact in fp32 and rounds to 1 in bf16/fp16-precision outputs."""
    key = (device.type, dtype)
    if key not in _FP32_OUTPUT_KIND:
        a = torch.tensor([[1.0, 2.0 ** -9]], dtype=dtype, device=device)
        b = torch.ones(2, 1, dtype=dtype, device=device)
        want = 1.0 + 2.0 ** -9
        kind = "upcast"
        try:
            c = torch.full((1, 1), 0.5, dtype=torch.float32, device=device)
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            if float(c) == 0.5 + want:
                kind = "addmm"
        except (RuntimeError, TypeError, NotImplementedError):
            pass
        if kind == "upcast":
            try:
                out = torch.mm(a, b, out_dtype=torch.float32)
                if out.dtype == torch.float32 and float(out) == want:
                    kind = "mm"
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        if kind == "upcast" and device.type == "cuda":
            warnings.warn(f"this torch has no GEMM with float32 output for {dtype} inputs on "
                          "CUDA (torch.mm/addmm out_dtype): weight gradients and the loss "
                          "head's logits run as float32 GEMMs on upcast copies (slower)")
        _FP32_OUTPUT_KIND[key] = kind
    return _FP32_OUTPUT_KIND[key]


def _native(t: torch.Tensor) -> bool:
    """Whether GEMMs of t's (bf16/fp16) dtype on t's device can write fp32 output themselves."""
    return _fp32_output_kind(t.device, t.dtype) in ("addmm", "mm")


def gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """`t` as matmul_fp32 takes it best when it is an operand of many GEMMs (a weight used by
    every chunk): itself where the device writes fp32 output from t's dtype (or t is fp32),
    else its fp32 copy (made once instead of once per GEMM)."""
    return t if t.dtype == torch.float32 or _native(t) else t.float()


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [k, n] as float32 [m, n]: fp32 products summed in fp32, the output never
    rounded to a bf16/fp16 input dtype (inputs of different dtypes: both as fp32)."""
    if a.dtype == b.dtype and a.dtype != torch.float32 and _native(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def accumulate_matmul_fp32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c [m, n] (float32) += a [m, k] @ b [k, n], the product never rounded to a bf16/fp16
    input dtype. fp32 inputs: `c.add_(a @ b)` (GEMM, then add: as an unfused gradient path)."""
    if c.dtype != torch.float32:
        raise TypeError(f"accumulate_matmul_fp32_: c must be float32, got {c.dtype}")
    if a.dtype == b.dtype == torch.float32:
        c.add_(torch.mm(a, b))
        return
    kind = _fp32_output_kind(a.device, a.dtype) if a.dtype == b.dtype else "upcast"
    if kind == "addmm":
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    elif kind == "mm":
        c.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        c.addmm_(a.float(), b.float())


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """Apex's contract: main_grad [out, in] (float32) += grad_output [T, out]^T @
    total_input [T, in], accumulated in float32."""
    accumulate_matmul_fp32_(main_grad, grad_output.t(), total_input)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """Apex's contract for a bf16/fp16 main_grad [out, in]: main_grad += grad_output^T @
    total_input in one GEMM (the sum rounded once to main_grad's dtype)."""
    if grad_output.dtype != main_grad.dtype or total_input.dtype != main_grad.dtype:
        raise TypeError(f"wgrad_gemm_accum_fp16: inputs {total_input.dtype}/"
                        f"{grad_output.dtype} and main_grad {main_grad.dtype} must match")
    main_grad.addmm_(grad_output.t(), total_input)


def accumulates_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether a weight gradient should be added to `weight.main_grad` directly: a bf16/fp16
    parameter megatron DDP gave an fp32 main_grad (parallel.grad_reduce_in_fp32, the default)."""
    main = getattr(weight, "main_grad", None)
    return (weight.dtype != torch.float32 and main is not None and main.dtype == torch.float32
            and hasattr(weight, "grad_added_to_main_grad"))


def main_grad_autograd_result(weight: torch.Tensor) -> torch.Tensor | None:
    """What a backward hands autograd as `weight`'s gradient once it added that gradient to
    main_grad itself (megatron's LinearWithGradAccumulationAndAsyncCommunication protocol):
    DDP's hook then adds nothing (`grad_added_to_main_grad`) but still runs (bucket readiness
    with overlap_grad_reduce), so autograd gets a dummy. A weight megatron marks
    `zero_out_wgrad` (tied embeddings at pp=1: the embedding lookup's gradient reaches
    param.grad too, and DDP's hook adds param.grad whatever the flag) gets None: param.grad
    then holds the lookup's gradient alone, and that run of the hook adds it."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return None
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _stand_in() -> types.ModuleType:
    module = types.ModuleType(APEX_MODULE, "torch stand-in for Apex's fused weight-gradient "
                                           "accumulation (models.build.wgrad_fp32)")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    return module


def install() -> None:
    """Register the stand-in where megatron-core imports Apex's module from (idempotent; a real
    Apex that megatron already imported is kept). The registry's entry
    `wgrad_fp32_apex_stand_in` (models.build.megatron_patches) gates it: PatchRefused outside
    the megatron-core versions it was written for."""
    if (not megatron_patches.gate("wgrad_fp32_apex_stand_in")
            or getattr(layers, "_grad_accum_fusion_available", False)):
        return
    module = sys.modules.get(APEX_MODULE) or _stand_in()
    sys.modules[APEX_MODULE] = module   # megatron.core.utils imports it inside a function
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True


def enable(chunks: list) -> int:
    """Switch megatron's gradient_accumulation_fusion on for every Column/RowParallelLinear of
    `chunks` (before megatron DDP wraps them; module docstring). Returns how many linears."""
    install()
    count = 0
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if config is not None:
            config.gradient_accumulation_fusion = True
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.gradient_accumulation_fusion = True
                count += 1
    return count
