"""MoE experts computed as one grouped computation per layer (no Python loop over experts),
without Transformer Engine.

`GroupedExperts` is megatron's `SequentialMLP` with another forward: it keeps SequentialMLP's
modules (`local_experts.{j}.linear_fc1/linear_fc2`, one ColumnParallel/RowParallel MLP per
local expert), so its parameter names, `sharded_state_dict` (megatron's global-expert
layout), the HF <-> Megatron mapping (models.layers.experts.mapping), the tensor-parallel tags and
the RL weight sync are exactly those of SequentialMLP. Only the computation differs: per
forward the local experts' weights are stacked ([E, 2I/etp, H] and [E, H, I/etp]; an
O(weights) copy whose backward hands each expert its own slice of the gradient) and the
tokens, which megatron's token dispatcher has already sorted by local expert
(`tokens_per_expert`), go through two grouped matmuls:

- on CUDA in bf16 with `torch._grouped_mm` (torch >= 2.8, compute capability >= 9.0:
  Hopper), when the matrix sizes meet its 16-byte stride rule (`grouped_mm_usable`);
- on the CPU (fp32 or bf16) with `torch._grouped_mm` too where this torch implements it there
  (probed once, `cpu_grouped_mm`; torch 2.13 does, as a loop over the groups in C++ with the
  same per-group matmuls as SequentialMLP);
- anywhere else (fp32 on GPUs, older GPUs or torch, odd sizes) a single padded `torch.bmm`
  over the experts: each expert's rows are copied into an [E, max tokens per expert, K]
  buffer whose padding rows are zero (memory and work E x the busiest expert's tokens; the
  padding contributes exact zeros to every gradient).

Expert-tensor parallelism needs no communication here: megatron's expert linears run as
plain matmuls (`explicit_expert_comm`) and the token dispatcher gathers/scatters over the
expert-TP group around the experts; with an expert-TP group of one the linears' TP collectives
are identities. The activation is megatron's MLP activation (SwiGLU for the families here,
with the routing probabilities applied after it, as `MLP.forward(per_token_scale=probs)`),
or megatron's fused weighted SwiGLU when `bias_activation_fusion` is on. Configurations this
path does not cover exactly (expert biases, fp8/fp4, TE activation functions, apply-probs-on-
input, another expert module layout) run SequentialMLP's own forward: `sequential_reason`.
LoRA adapters on the expert linears (models.lora, peft's target_parameters format) join the
grouped computation through each linear's `low_rank_factors` (`_plus_low_rank`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

GROUPED_MM_MIN_TORCH = (2, 8)
GROUPED_MM_MIN_CAPABILITY = (9, 0)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


_CPU_GROUPED_MM: bool | None = None


def cpu_grouped_mm() -> bool:
    """Whether this torch computes `torch._grouped_mm` on CPU tensors, with the right numbers
    (probed once on a 2-group example)."""
    global _CPU_GROUPED_MM
    if _CPU_GROUPED_MM is None:
        try:
            x, w = torch.arange(16.0).view(2, 8), torch.ones(2, 8, 4)
            w[1] *= 2
            out = torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32))
            _CPU_GROUPED_MM = torch.equal(out, torch.stack([x[0] @ w[0], x[1] @ w[1]]))
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _CPU_GROUPED_MM = False
    return _CPU_GROUPED_MM


def grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can compute x [T, K] against stacked w [E, N, K] here:
    K and N multiples of 16 bytes (its stride rule), and on the CPU fp32/bf16 tensors with a
    torch that implements it there (`cpu_grouped_mm`), on CUDA bf16 tensors, torch >= 2.8 with
    the op and a Hopper-or-newer device."""
    if x.dtype != w.dtype or x.device.type != w.device.type:
        return False
    align = 16 // x.element_size()
    if x.shape[-1] % align or w.shape[1] % align:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16) and cpu_grouped_mm()
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if not hasattr(torch, "_grouped_mm") or _torch_version() < GROUPED_MM_MIN_TORCH:
        return False
    return torch.cuda.get_device_capability(x.device) >= GROUPED_MM_MIN_CAPABILITY


def padded_grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x [T, K] sorted by group (group e holds `counts[e]` consecutive rows) times the
    transpose of their group's weight w[e] [N, K]: [T, N], as one padded bmm. Exact: every
    output row is the dot products of its own input row with its own group's weight; padding
    rows are zeros that contribute nothing to any gradient."""
    num, rows = len(counts), max(counts, default=0)
    count_t = torch.tensor(counts, device=x.device, dtype=torch.long)
    group = torch.repeat_interleave(torch.arange(num, device=x.device), count_t)
    starts = torch.cumsum(count_t, 0) - count_t
    slot = group * rows + (torch.arange(x.shape[0], device=x.device) - starts[group])
    padded = x.new_zeros(num * rows, x.shape[1]).index_copy(0, slot, x)
    out = torch.bmm(padded.view(num, rows, x.shape[1]), w.transpose(1, 2))
    return out.reshape(num * rows, w.shape[1]).index_select(0, slot)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor,
                   kernel: str = "auto") -> torch.Tensor:
    """x [T, K] (rows sorted by expert, `tokens_per_expert` [E] of them each) through each
    row's expert weight of w [E, N, K] -> [T, N]. `kernel`: "auto" (torch._grouped_mm where
    `grouped_mm_usable`, else the padded bmm), "grouped_mm" or "padded" (tests)."""
    if kernel == "grouped_mm" or (kernel == "auto" and grouped_mm_usable(x, w)):
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if out.requires_grad:  # its backward refuses stride-0 (expanded) gradients
            out.register_hook(lambda grad: grad.contiguous())
        return out
    if kernel not in ("auto", "padded"):
        raise ValueError(f"grouped_linear: unknown kernel {kernel!r} (auto, grouped_mm, padded)")
    return padded_grouped_linear(x, w, [int(c) for c in tokens_per_expert.tolist()])


class GroupedExperts(SequentialMLP):
    """SequentialMLP's modules and checkpoint layout, one grouped computation per forward
    (module docstring). `kernel` selects grouped_linear's kernel (tests force one)."""

    kernel = "auto"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequential_reason = self._sequential_reason()

    def _sequential_reason(self) -> str | None:
        """Why this configuration runs SequentialMLP's forward instead (None: grouped)."""
        cfg = self.config
        if cfg.add_bias_linear:
            return "expert biases"
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            return "fp8/fp4 experts"
        if cfg.moe_apply_probs_on_input or getattr(cfg, "use_te_activation_func", False):
            return "moe_apply_probs_on_input / use_te_activation_func"
        if cfg.bias_activation_fusion and not (cfg.gated_linear_unit
                                               and cfg.activation_func is F.silu):
            return "bias_activation_fusion with an activation other than SwiGLU"
        for expert in self.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                group = getattr(linear, "tp_group", None)
                if not (getattr(linear, "explicit_expert_comm", False)
                        or group is None or group.size() == 1):
                    return "expert linears with their own tensor-parallel communication"
                if not isinstance(getattr(linear, "weight", None), torch.Tensor):
                    return "expert linears without a plain weight"
        return None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron MLP's activation then the per-token routing weight (MLP.forward with
        per_token_scale=probs), or its fused weighted SwiGLU under bias_activation_fusion."""
        cfg = self.config
        if cfg.bias_activation_fusion:
            # the fused kernel module only where bias_activation_fusion is on (GPU hosts)
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1),
                                             cfg.activation_func_fp8_input_store)
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            h2 = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        else:
            h2 = cfg.activation_func(h)
        return (h2 * probs.unsqueeze(-1)).to(h2.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, *args, **kwargs):
        """[T, H] tokens sorted by local expert, their counts [E] and routing weights [T]
        -> ([T, H] expert outputs, None); the same contract as SequentialMLP.forward."""
        if self.sequential_reason is not None or args or kwargs:
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs, *args, **kwargs)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I', H]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I']
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        x = permuted_local_hidden_states
        hidden = self._plus_low_rank(grouped_linear(x, fc1, tokens_per_expert, self.kernel), x,
                                     "linear_fc1", tokens_per_expert)
        hidden = self._activation(hidden, permuted_probs)
        out = grouped_linear(hidden, fc2, tokens_per_expert, self.kernel)
        return self._plus_low_rank(out, hidden, "linear_fc2", tokens_per_expert), None

    def _plus_low_rank(self, out: torch.Tensor, x: torch.Tensor, linear: str,
                       tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """`out` plus the local experts' low-rank updates of `linear` for their tokens x:
        x A_e^T B_e^T, as two more grouped matmuls. The updates are LoRA adapters (models.lora
        sets `low_rank_factors` on each expert linear: () -> (A [r, K], B [N, r]) or None while
        switched off); `out` unchanged when the linears carry none."""
        factors = [getattr(getattr(e, linear), "low_rank_factors", None)
                   for e in self.local_experts]
        factors = [f() for f in factors] if all(factors) else []
        if not factors or any(f is None for f in factors):
            return out
        a = torch.stack([f[0] for f in factors])   # [E, r, K]
        b = torch.stack([f[1] for f in factors])   # [E, N, r]
        low = grouped_linear(grouped_linear(x, a, tokens_per_expert, self.kernel), b,
                             tokens_per_expert, self.kernel)
        return out + low.to(out.dtype)
