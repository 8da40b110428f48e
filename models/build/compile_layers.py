"""`train.compile`: torch.compile per transformer layer (torchtitan's per-block compilation).

`compile_layers(chunks)` compiles, in place, every transformer layer of the megatron model
chunks of this rank (the decoder's layers of each GPTModel chunk; MTP layers and vision towers
stay eager):

- every layer compiles its norms, its core attention (RoPE is applied before it, by
  megatron's attention module, eager) with its q/k norms, and an MoE layer's router, each a
  region of its own; megatron's linears and the MLP activation between them stay eager, as do
  an MoE layer's experts (models.layers.experts.grouped: one grouped GEMM) and its token
  dispatcher. The linears cannot be traced: their autograd functions start tensor-parallel
  collectives in the backward and, with the fp32 weight-gradient accumulation every trained
  model has (models.build.wgrad_fp32), assign `weight.main_grad` there, a side effect dynamo
  refuses (a whole layer compiled then broke at every linear);
- its SDPA core attention (models.layers.attention.core) serves grouped KV heads with SDPA's
  own `enable_gqa` instead of repeating K and V (`native_gqa`); packed rows' attention, whose
  loop over the host's segment bounds is wrapped in torch.compiler.disable, stays eager.

Shapes: torch's automatic dynamic shapes: a region is first compiled for the shapes it meets;
when a micro-batch's length differs it is compiled once more with symbolic sizes, and no more
after that. With stable shapes (fixed-length packed rows) every region keeps its static graph.
Dynamo's recompile limit (a per-code-object count of cached graphs; every layer shares
`Module._call_impl`'s code) is raised to `GRAPHS_PER_LAYER` per layer of this process so that
each layer keeps its own graphs.

Backend: inductor, through a wrapper that counts the graphs it is given and the recompiles
among them (a compile of a frame already compiled before); graph breaks come from dynamo's own
counters. `compile_stats()` returns the three counts of this process; the engine reports them
as metrics (compile/graphs, compile/recompiles, compile/graph_breaks).

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
import threading
from dataclasses import dataclass

import torch
from megatron.core import parallel_state, utils
from megatron.core.tensor_parallel import layers, mappings
from torch._guards import CompileContext

# graphs a layer may hold for one code object: static and dynamic shapes, with and without
# grad (RL's log-prob recomputation), times two for regions split by a graph break
GRAPHS_PER_LAYER = 8

_LOCK = threading.Lock()


@dataclass
class CompileStats:
    """Counts of this process since it started (all compiled layers together)."""

    graphs: int = 0        # graphs inductor compiled for the layers (forward graphs)
    recompiles: int = 0    # of these, compiles of a frame that already had a graph
    graph_breaks: int = 0  # dynamo graph breaks met while tracing (any compiled code)


_STATS = CompileStats()


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs):
    """Inductor, counting the graph (and whether it is a recompile of its frame)."""
    # Inductor loads on the first compile only (seconds of imports a run without it skips)
    from torch._inductor.compile_fx import compile_fx

    compile_id = CompileContext.current_compile_id()
    with _LOCK:
        _STATS.graphs += 1
        if compile_id is not None and (compile_id.frame_compile_id or 0) > 0:
            _STATS.recompiles += 1
    return compile_fx(gm, example_inputs)


def compile_stats() -> CompileStats:
    """The graph, recompile and graph-break counts of this process so far."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")   # loaded by any compile
    breaks = 0 if dynamo_utils is None else sum(dynamo_utils.counters["graph_break"].values())
    return CompileStats(_STATS.graphs, _STATS.recompiles, int(breaks))


def describe_stats(stats: CompileStats) -> str:
    """e.g. "compile: 16 graphs, 4 recompiles, 4 graph breaks"."""
    return (f"compile: {stats.graphs} graphs, {stats.recompiles} recompiles, "
            f"{stats.graph_breaks} graph breaks")


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
    layers = sum(len(_layers(c)) for c in chunks)
    limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_LAYER * max(layers, 1))
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
    regions = 0
    for chunk in chunks:
        count = 0
        for layer in _layers(chunk):
            count += _compile_layer(layer)
        getattr(chunk, "module", chunk).compiled_regions = count
        regions += count
    return regions


def _compile_layer(layer) -> int:
    """Compile one layer's regions (SDPA attention switched to its own GQA, packed attention
    kept eager); returns how many."""
    for module in layer.modules():
        if hasattr(module, "native_gqa"):   # models.layers.attention.core.SDPACoreAttention
            module.native_gqa = True
            if not getattr(module.packed_attention, "_torchdynamo_disable", False):
                module.packed_attention = torch.compiler.disable(module.packed_attention)
    regions = _regions(layer)
    for region in regions:
        if getattr(region, "_compiled_call_impl", None) is None:
            region.compile(backend=_counting_inductor)
    return len(regions)


def _quiet_megatron_tp_group_default() -> None:
    """Two warnings megatron-core issues from inside every layer's forward, each a graph break
    for dynamo: RowParallelLinear passes `tp_group=None` to its linear function, whose
    `get_tensor_model_parallel_group_if_none` then issues a DeprecationWarning on rank 0 before
    returning the default group; the same lookup without the warning (same group, same
    arguments) replaces it where the tensor-parallel layers and mappings call it. And the
    sequence-parallel linear's one-time advice to set CUDA_DEVICE_MAX_CONNECTIONS is marked as
    given. Numerics untouched. Idempotent."""
    if getattr(layers.get_tensor_model_parallel_group_if_none, "_engine_quiet", False):
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
