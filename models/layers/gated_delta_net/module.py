"""The Gated DeltaNet layer of Qwen3.5 (HF `Qwen3_5GatedDeltaNet`) as a megatron module, with
tensor, sequence and context parallelism and packed sequences.

megatron-core's own `GatedDeltaNet` (0.16) needs flash-linear-attention to construct, refuses
packed sequences and has no context parallelism; this module keeps its parameter layout and
its distributed-checkpoint format (it reuses megatron's `sharded_state_dict`), so checkpoints
are the same, and adds what it lacks:

- parameters per TP rank (heads split over TP: key heads nk/tp, value heads nv/tp, contiguous):
  `in_proj.weight` [q_r; k_r; v_r; z_r; b_r; a_r] (ColumnParallelLinear), `conv1d.weight`
  [q_r; k_r; v_r] x 1 x K, `A_log` / `dt_bias` [nv/tp], `out_norm.weight` [dv] (replicated; its
  gradient is summed over TP, each rank normalising other heads), `out_proj.weight`
  (RowParallelLinear);
- packed rows ("thd", b = 1): the conv window and the recurrent state restart at every segment
  start of `packed_seq_params.cu_seqlens_q_padded`;
- context parallelism, Ulysses style (parallel.ulysses): the pre-conv q/k/v and the per-head
  beta/decay inputs go through an all-to-all to whole sequences with heads split over CP
  (natural order restored from the zigzag shards), the conv and the rule run on whole
  sequences, and a second all-to-all returns the outputs to sequence shards.

Shapes: input/output [s/sp, b, hidden] (sbhd, sp = tp with sequence parallelism, per CP shard).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule

from models.layers.gated_delta_net.rule import l2norm, segmented_gated_delta_rule
from models.layers.norms.zero_centered import gated_rms_norm
from parallel import ulysses, zigzag


class GatedDeltaNetError(ValueError):
    """A layout the Gated DeltaNet layer cannot run exactly."""


class _NormWeight(torch.nn.Module):
    def __init__(self, size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """Depthwise causal conv1d + silu over [b, c, s] (weight [c, K]), the window restarting at
    every segment start in `bounds` (None: one segment per row). As HF: computed in the
    weight's dtype, returned in x's."""
    kernel = weight.shape[-1]

    def conv(part):
        out = F.conv1d(F.pad(part.to(weight.dtype), (kernel - 1, 0)), weight.unsqueeze(1),
                       groups=weight.shape[0])
        return F.silu(out).to(x.dtype)

    if bounds is None:
        return conv(x)
    return torch.cat([conv(x[..., a:e]) for a, e in zip(bounds[:-1], bounds[1:]) if e > a],
                     dim=-1)


class GatedDeltaNet(MegatronModule):
    """Spec-built like megatron's attention (config, layer_number); forward returns (out, None)."""

    def __init__(self, config, layer_number: int | None = None, pg_collection=None, **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        tp = ps.get_tensor_model_parallel_world_size()
        self.tp_size, self.cp_size = tp, ps.get_context_parallel_world_size()
        self.pg_collection = pg_collection or SimpleNamespace(
            tp=ps.get_tensor_model_parallel_group())
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, \
            config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, \
            config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
        self.conv_dim_local_tp = (2 * self.qk_dim + self.v_dim) // tp
        self.conv_bias = False
        # what megatron's sharded_state_dict reads (0.19 names its in_proj split sections)
        self.qk_dim_local_tp, self.v_dim_local_tp = self.qk_dim // tp, self.v_dim // tp
        self.in_proj_split_names = ["query", "key", "value", "z", "beta", "alpha"]
        self.in_proj_split_sections = tuple(self._local_sizes())
        _check_heads(self.num_key_heads, self.num_value_heads, tp, self.cp_size)
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, self.in_proj_dim, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False)
        self.conv1d = torch.nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp,
                                      kernel_size=config.linear_conv_kernel_dim, bias=False,
                                      groups=self.conv_dim_local_tp,
                                      dtype=config.params_dtype)
        heads = self.num_value_heads // tp
        self.dt_bias = torch.nn.Parameter(torch.ones(heads, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.out_norm = _NormWeight(self.value_head_dim, config.params_dtype)
        self.out_proj = tensor_parallel.RowParallelLinear(
            self.v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True)
        self.eps = config.layernorm_epsilon
        self.restart_segments = True   # False only in tests (negative control: state leaks)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """megatron's GatedDeltaNet format: in_proj split into query/key/value/z/beta/alpha,
        conv1d into query/key/value, A_log / dt_bias sharded on dim 0 (any TP reshards)."""
        return MegatronGatedDeltaNet.sharded_state_dict(self, prefix, sharded_offsets, metadata,
                                                        tp_group)

    def _local_sizes(self) -> list[int]:
        tp = self.tp_size
        return [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp, self.v_dim // tp,
                self.num_value_heads // tp, self.num_value_heads // tp]

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        mixed, _ = self.in_proj(hidden_states)                 # [s, b, in/tp], whole CP shard
        s, b = mixed.shape[:2]
        q, k, v, z, beta, alpha = torch.split(mixed, self._local_sizes(), dim=-1)
        q = q.reshape(s, b, -1, self.key_head_dim)
        k = k.reshape(s, b, -1, self.key_head_dim)
        v = v.reshape(s, b, -1, self.value_head_dim)
        bounds = _bounds(packed_seq_params)
        weights = self._head_parameters()
        if self.cp_size > 1:
            q, k, v, beta, alpha = self._exchange(q, k, v, beta, alpha, bounds)
        out = self._mix(q, k, v, beta, alpha, weights, bounds if self.restart_segments else None)
        if self.cp_size > 1:
            out = self._exchange_back(out, bounds)
        norm_weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm.weight)
        out = gated_rms_norm(out, z.reshape(out.shape), norm_weight, self.eps)
        return self.out_proj(out.reshape(s, b, -1))

    def _head_parameters(self):
        """(conv weights of q, k, v [c, K]; A_log; dt_bias) of the heads this rank computes:
        its TP heads, and with CP its CP rank's share of them."""
        local = self.conv1d.weight[:, 0, :]
        qk, vv = self.qk_dim // self.tp_size, self.v_dim // self.tp_size
        conv_q, conv_k, conv_v = torch.split(local, [qk, qk, vv], dim=0)
        params = [conv_q, conv_k, conv_v, self.A_log, self.dt_bias]
        if self.cp_size > 1:
            rank = ps.get_context_parallel_rank()
            params = [p.chunk(self.cp_size, dim=0)[rank] for p in params]
        return params

    def _exchange(self, q, k, v, beta, alpha, bounds):
        """Sequence shards -> whole sequences in natural order, heads split over CP."""
        group = ps.get_context_parallel_group()
        parts = ulysses.seq_to_heads_many([q, k, v, beta, alpha], group, 0, 2)
        order = zigzag.gathered_to_natural(_segments(bounds, parts[0].shape[0]), self.cp_size)
        return [x.index_select(0, order.to(x.device)) for x in parts]

    def _exchange_back(self, out, bounds):
        order = zigzag.gathered_to_natural(_segments(bounds, out.shape[0]), self.cp_size)
        out = out.index_select(0, torch.argsort(order).to(out.device))
        return ulysses.heads_to_seq(out, ps.get_context_parallel_group(), 0, 2)

    def _mix(self, q, k, v, beta, alpha, weights, bounds):
        """conv + silu, l2-normalised q/k, the gated delta rule. Inputs [s, b, heads, d] and
        [s, b, heads]; returns [s, b, value heads, dv]."""
        conv_q, conv_k, conv_v, a_log, dt_bias = weights
        s, b = q.shape[:2]

        def conv(x, w):
            flat = x.reshape(s, b, -1).permute(1, 2, 0)        # [b, c, s]
            return causal_conv(flat, w, bounds).permute(0, 2, 1).reshape(b, s, *x.shape[2:])

        q, k, v = conv(q, conv_q), conv(k, conv_k), conv(v, conv_v)
        q, k = l2norm(q.float()), l2norm(k.float())
        ratio = v.shape[2] // q.shape[2]
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        g = -a_log.float().exp() * F.softplus(alpha.float().transpose(0, 1) + dt_bias)
        out = segmented_gated_delta_rule(q, k, v, g, beta.transpose(0, 1).sigmoid(), bounds)
        return out.to(v.dtype).transpose(0, 1)


def _check_heads(key_heads: int, value_heads: int, tp: int, cp: int) -> None:
    for name, heads in (("linear_num_key_heads", key_heads),
                        ("linear_num_value_heads", value_heads)):
        if heads % (tp * cp):
            raise GatedDeltaNetError(
                f"{name}={heads} is not divisible by tp x cp = {tp} x {cp}: Gated DeltaNet "
                "layers split their heads over tensor parallelism and, with context "
                "parallelism, over the CP ranks too (Ulysses); choose tp x cp dividing it")


def _bounds(packed_seq_params) -> list[int] | None:
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    return [int(x) for x in cu.tolist()]


def _segments(bounds: list[int] | None, total: int) -> list[int]:
    if bounds is None:
        return [total]
    return [e - a for a, e in zip(bounds[:-1], bounds[1:])]
