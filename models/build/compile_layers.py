"""`train.compile`: torch.compile per transformer layer (torchtitan's per-block compilation).

`compile_layers(chunks)` compiles, in place, every transformer layer of the megatron model
chunks of this rank (the decoder's layers of each GPTModel chunk; MTP layers and vision towers
stay eager):

- every layer compiles its norms, its core attention (RoPE is applied before it, by
  megatron's attention module, eager) with its q/k norms, and an MoE layer's router, each a
  region of its own (`CompiledRegion`: the module's `forward` under torch.compile); megatron's
  linears and the MLP activation between them stay eager, as do an MoE layer's experts
  (models.layers.experts.grouped: one grouped GEMM) and its token dispatcher. The linears
  cannot be traced: their autograd functions start tensor-parallel collectives in the backward
  and, with the fp32 weight-gradient accumulation every trained model has
  (models.build.wgrad_fp32), assign `weight.main_grad` there, a side effect dynamo refuses (a
  whole layer compiled then broke at every linear);
- its SDPA core attention (models.layers.attention.core) serves grouped KV heads with SDPA's
  own `enable_gqa` instead of repeating K and V (`native_gqa`);
- packed ("thd") rows never enter the compiled attention: the core attention's region runs
  its eager forward for them (`packed_rows`), at every CP size. Their attention is driven by
  the host-known segment bounds (the per-segment loop, Ulysses' segment list and zigzag
  index), Python values that dynamo would bake into the graph and guard on: traced, every new
  number of sequences in a row (and at CP > 1 every new set of bounds) was a re-trace. The
  packed row's norms and router are compiled like any other (their only varying size is the
  row's token count). A prefix tree's row (train.prefix_sharing, parallel.tree_attention) is a
  packed row too: its tree attention (host-known chains and key spans) runs eagerly here, and
  its RoPE positions (`tree_positions` on its cu_seqlens) are read by megatron's eager RoPE
  before the core attention, so no tree compiles a graph (tests/test_prefix_sharing_compile.py).

Shapes: static, except the token dims of every region's inputs (the sequence and rows of a
padded micro-batch, the tokens of a packed row), marked dynamic at every call
(`torch._dynamo.maybe_mark_dynamic`; `CompiledRegion`), so a region's first graph serves every
length and row count (a size of 0 or 1 keeps a graph of its own): a region compiles once per
grad mode, and a length or row count first seen late in a run compiles nothing. Head counts and
hidden sizes stay static: dynamo's automatic dynamic shapes, which would make any size seen
with two values symbolic, are off (`dynamic=False`), because its memory of sizes is per code
object: every layer's norm shares one `forward`, so regions of other models in the process
(an RL critic or teacher, another test) would make each other's head and hidden sizes
symbolic (symbolic heads were a TypeError in SDPA's GQA check, a graph break).

Limits, per region: each region's torch.compile has its own cache (`isolate_recompiles`) and
its own recompile limit, `GRAPHS_PER_REGION` graphs; beyond it that region runs eagerly.
Dynamo's second cap, `accumulated_recompile_limit` (graphs of one code object over all regions:
every layer's norm shares torch's RMSNorm `forward`), is raised to the regions' total only while
a compiled region runs (a dynamo config patch entered by `CompiledRegion`), so the process-wide
settings, those of the rollout's compiled decode and of user code, stay torch's.

Counts: the regions' backend counts graphs and recompiles (models.build.compile_counts); the
engine reports them as metrics (compile/graphs, compile/recompiles, compile/graph_breaks).

Exactness: the compiled regions compute the same operations as eager; inductor fuses
element-wise chains and may reorder floating-point reductions, so fp32 results agree to
rounding (tests/test_train_compile.py: rel 1e-5 at every layout), not bitwise. Off
(`compile_layers` never called), the model is the eager megatron model, untouched.

On a CPU host megatron runs under parallel.cpu_runtime's device-mapping TorchFunctionMode;
dynamo (torch >= 2.13) traces through an active TorchFunctionMode, so the same compiled
layers run there (inductor's C++ backend), which is how the suite proves exactness.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from megatron.core import parallel_state, utils
from megatron.core.tensor_parallel import layers, mappings

from models.build import megatron_patches
from models.build.compile_counts import count_graphs

# graphs one region may hold: static and dynamic shapes, a size of 1 specialised, with and
# without grad (RL's log-prob recomputation)
GRAPHS_PER_REGION = 8

# the regions compiled in this process and the dynamo config patch their calls enter
# (accumulated_recompile_limit: GRAPHS_PER_REGION per region), None while torch's own cap is
# enough
_LIMITS: dict = {"regions": 0, "patch": None}


class CompiledRegion:
    """A module's `forward` under torch.compile (installed as the module's `forward`, so its
    hooks stay eager around it): Inductor through models.build.compile_counts.count_graphs,
    this region's own dynamo cache and recompile limit (GRAPHS_PER_REGION), dynamo's
    accumulated cap raised only while it runs. Shapes: static (`dynamic=False`) except the
    token dims of its tensor arguments, marked dynamic at every call: the leading dims before
    the last `feature_dims` ones, at most two ([s, b, hidden] and [t, hidden] with 1; q/k
    heads [s, b, heads, d] and packed [t, heads, d] with 2). `eager_when(args, kwargs)` true:
    this call runs the eager forward instead (the core attention's packed rows)."""

    def __init__(self, forward: Callable, eager_when: Callable | None = None,
                 feature_dims: int = 1):
        self.eager = forward
        self.eager_when = eager_when
        self.feature_dims = feature_dims
        self.compiled = torch.compile(forward, backend=count_graphs, dynamic=False,
                                      recompile_limit=GRAPHS_PER_REGION, isolate_recompiles=True)

    def __call__(self, *args, **kwargs):
        if self.eager_when is not None and self.eager_when(args, kwargs):
            return self.eager(*args, **kwargs)
        for x in args:   # the token dims: all but the trailing feature dims, at most 2
            if isinstance(x, torch.Tensor):
                for dim in range(min(2, x.dim() - self.feature_dims)):
                    torch._dynamo.maybe_mark_dynamic(x, dim)
        patch = _LIMITS["patch"]
        if patch is None:
            return self.compiled(*args, **kwargs)
        with patch:
            return self.compiled(*args, **kwargs)


def packed_rows(args: tuple, kwargs: dict) -> bool:
    """Whether a core attention call (megatron's signature: query, key, value, attention_mask,
    attn_mask_type, attention_bias, packed_seq_params) carries packed ("thd") rows."""
    params = kwargs.get("packed_seq_params", args[6] if len(args) > 6 else None)
    return params is not None and getattr(params, "qkv_format", None) == "thd"


def _layers(chunk) -> list:
    """The transformer layers of a (DDP-unwrapped) model chunk's decoder."""
    model = getattr(chunk, "module", chunk)
    model = getattr(model, "language_model", model)   # vision-language wrapper
    decoder = getattr(model, "decoder", None)
    return list(getattr(decoder, "layers", []) or [])


def _regions(layer) -> list[torch.nn.Module]:
    """What to compile of one layer: its norms, its core attention (with its q/k norms) and an
    MoE layer's router, each a region of its own; megatron's linears stay eager between them
    (and an MoE layer's experts on their grouped GEMM). The linears' autograd functions do not
    trace: their backward starts tensor-parallel collectives and, with the fp32 weight-gradient
    accumulation every trained model has (models.build.wgrad_fp32, megatron's
    gradient_accumulation_fusion), assigns `weight.main_grad`, a side effect dynamo refuses:
    traced, every linear became a graph break (37 in one 2-layer step). A region without
    parameters or computation (megatron's IdentityOp) is left out, except the core
    attention."""
    attention = layer.self_attention
    moe = getattr(layer, "is_moe_layer", False)
    core = getattr(attention, "core_attention", None)   # none: a linear-attention mixer
    parts = [core, getattr(attention, "q_layernorm", None),
             getattr(attention, "k_layernorm", None)] if core is not None else []
    regions = [layer.input_layernorm, *parts, layer.pre_mlp_layernorm]
    if moe:
        regions.append(layer.mlp.router)
    return [r for r in regions if isinstance(r, torch.nn.Module)
            and (r is core or any(True for _ in r.parameters()))]


def has_compiled_layers(chunks: list) -> bool:
    """Whether `compile_layers` compiled these model chunks (DDP-wrapped or not)."""
    return any(getattr(getattr(c, "module", c), "compiled_regions", 0) for c in chunks)


def compile_layers(chunks: list) -> int:
    """Compile every transformer layer of `chunks` in place (see the module docstring) and
    mark each chunk with its count (`compiled_regions`); returns the number of compiled
    regions. Idempotent per module."""
    _quiet_megatron_tp_group_default()
    regions = new = 0
    for chunk in chunks:
        count = 0
        for layer in _layers(chunk):
            new += _compile_layer(layer)
            count += len(_regions(layer))
        getattr(chunk, "module", chunk).compiled_regions = count
        regions += count
    _raise_accumulated_cap(new)
    return regions


def _raise_accumulated_cap(new_regions: int) -> None:
    """Count `new_regions` more regions in this process; when their graphs could exceed
    dynamo's accumulated_recompile_limit, the regions' calls enter a config patch raising it to
    GRAPHS_PER_REGION per region (the process-wide value untouched)."""
    _LIMITS["regions"] += new_regions
    cap = GRAPHS_PER_REGION * _LIMITS["regions"]
    if cap > torch._dynamo.config.accumulated_recompile_limit:
        _LIMITS["patch"] = torch._dynamo.config.patch(accumulated_recompile_limit=cap)


def _compile_layer(layer) -> int:
    """Compile one layer's regions (SDPA attention switched to its own GQA, packed rows kept
    on its eager forward); returns how many regions it newly compiled."""
    attention = layer.self_attention
    per_head = [getattr(attention, "q_layernorm", None), getattr(attention, "k_layernorm", None)]
    count = 0
    for region in _regions(layer):
        if isinstance(region.forward, CompiledRegion):
            continue
        core = hasattr(region, "native_gqa")   # models.layers.attention.core.SDPACoreAttention
        if core:
            region.native_gqa = True
        heads = core or any(region is norm for norm in per_head)   # [.., heads, head dim]
        region.forward = CompiledRegion(region.forward, eager_when=packed_rows if core else None,
                                        feature_dims=2 if heads else 1)
        count += 1
    return count


def _quiet_megatron_tp_group_default() -> None:
    """Two warnings megatron-core issues from inside every layer's forward, each a graph break
    for dynamo: RowParallelLinear passes `tp_group=None` to its linear function, whose
    `get_tensor_model_parallel_group_if_none` then issues a DeprecationWarning on rank 0 before
    returning the default group; the same lookup without the warning (same group, same
    arguments) replaces it where the tensor-parallel layers and mappings call it. And the
    sequence-parallel linear's one-time advice to set CUDA_DEVICE_MAX_CONNECTIONS is marked as
    given. Numerics untouched. Idempotent; applied only where the registry's gate lets it
    through (models.build.megatron_patches, entry quiet_tp_group_default: outside its
    megatron-core range megatron's own lookup runs, warnings and graph breaks included)."""
    if getattr(layers.get_tensor_model_parallel_group_if_none, "_engine_quiet", False):
        return
    if not megatron_patches.gate("quiet_tp_group_default"):
        return

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if not torch.distributed.is_initialized():
            return None
        if not parallel_state.is_initialized() or tp_group is not None:
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(
                check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    # its sequence-parallel recommendation (CUDA_DEVICE_MAX_CONNECTIONS) is given once, by
    # setting an attribute on the function: a graph break under dynamo, in every TP linear
    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True
    group_if_none._engine_quiet = True
    group_if_none.__doc__ = utils.get_tensor_model_parallel_group_if_none.__doc__
    for module in (layers, mappings):
        module.get_tensor_model_parallel_group_if_none = group_if_none


def release_compile_threads() -> None:
    """Shut down inductor's compile thread pool (created on the first compile, recreated by
    the next one). Its worker threads are not daemons and wait for work forever, so a process
    ending through engine.cli.exit_process (which joins every non-daemon thread first) would
    hang on them; the engine calls this after every step of a compiled model. Cheap when no
    pool exists."""
    async_compile = sys.modules.get("torch._inductor.async_compile")  # none: never compiled
    pool = None if async_compile is None else async_compile.AsyncCompile.pool
    if pool is not None and pool.cache_info().currsize:
        pool().shutdown(wait=True)
        pool.cache_clear()
