"""Probes of the megatron-core code each patch of models.build.megatron_patches was written
against, and the checks that a patch is in effect.

A probe takes `get` (a dotted name -> the object megatron-core defines there; default
`original`, which sees through the engine's own replacements) and raises PatchMismatch, naming
the target and what differs, when the target no longer looks as the patch expects: its
parameters, the attributes it reads, the line of megatron's code the patch fixes, or a tiny
numeric comparison of the engine's drop-in against megatron's function. Passing another `get`
(tests hand it a fake target with a renamed parameter) shows that a change is caught. Probes
read megatron-core, never change it; the two whose target must not be imported early
(megatron's Muon module: imported once, after the engine's typing shim) or is replaced in place
by the CPU host runtime read megatron's source file instead (`source_defs`).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import types
from typing import Callable

import torch

ROPE = "megatron.core.models.common.embeddings.rope_utils"
BSHD, THD = f"{ROPE}._apply_rotary_pos_emb_bshd", f"{ROPE}._apply_rotary_pos_emb_thd"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
PERMUTE = "megatron.core.transformer.moe.token_dispatcher.permute"
A2A = "megatron.core.transformer.moe.moe_layer.MoEAlltoAllTokenDispatcher"
EXPERT_BIAS = "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias"
TP_LAYERS = "megatron.core.tensor_parallel.layers"
TP_MAPPINGS = "megatron.core.tensor_parallel.mappings"
GROUP_IF_NONE = "megatron.core.utils.get_tensor_model_parallel_group_if_none"
CLIP = "megatron.core.optimizer.clip_grads"
ASYNC_FS = "megatron.core.dist_checkpointing.strategies.filesystem_async"
LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer"
MUON = "megatron.core.optimizer.muon"
MLA = "megatron.core.transformer.multi_latent_attention"
RANDOM = "megatron.core.tensor_parallel.random"
MLA_FLAGS = ("multi_latent_attention", "mla_rotary_interleaved")   # 0.16-0.18, 0.19+


class PatchMismatch(RuntimeError):
    """A patch's target no longer looks like what the patch was written against."""


def resolve(dotted: str):
    """The object at `dotted`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def original(dotted: str):
    """megatron-core's own object at `dotted`: through an engine replacement to the
    `megatron_original` it records."""
    obj = resolve(dotted)
    return getattr(obj, "megatron_original", obj)


def replaced_by(dotted: str, module: str) -> bool:
    """Whether the object now at `dotted` was defined in the engine module `module`."""
    try:
        return getattr(resolve(dotted), "__module__", None) == module
    except (ImportError, AttributeError):
        return False


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise PatchMismatch(what)


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def flat_source(obj) -> str:
    """obj's source with all whitespace runs as one space (line breaks do not matter)."""
    return " ".join(inspect.getsource(obj).split())


def source_defs(module: str) -> dict[str, ast.FunctionDef]:
    """Every function and method definition of `module`'s source file by (qualified) name,
    read without importing the module."""
    spec = importlib.util.find_spec(module)
    expect(spec is not None and spec.origin is not None, f"{module}: no source file")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body
                          if isinstance(f, ast.FunctionDef)})
    return found


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def rope_bshd(get: Callable = original) -> None:
    fn = get(BSHD)
    p = params(fn)
    expect(p[:3] == ["t", "freqs", "rotary_interleaved"] and len(p) > 4 and p[3] in MLA_FLAGS
           and "mscale" in p, f"{BSHD} parameters {p}")
    expect(params(get(f"{ROPE}._rotate_half"))[:2] == ["x", "rotary_interleaved"],
           f"{ROPE}._rotate_half parameters")
    ours = get("models.layers.attention.rope_tables.apply_bshd")
    t, freqs = torch.randn(5, 2, 3, 8, generator=_gen()), torch.randn(5, 1, 1, 6, generator=_gen())
    for interleaved in (False, True):
        expect(torch.equal(ours(t, freqs, interleaved, False, 0.5),
                           fn(t, freqs, interleaved, False, 0.5)),
               f"{BSHD}: the cached-table drop-in no longer equals it bitwise")


def rope_thd(get: Callable = original) -> None:
    p = params(get(THD))
    expect(p[:4] == ["t", "cu_seqlens", "freqs", "rotary_interleaved"] and p[4] in MLA_FLAGS
           and p[5:7] == ["mscale", "cp_group"], f"{THD} parameters {p}")


def moe_te_general_gemm(get: Callable = original) -> None:
    src = flat_source(get(f"{MOE_UTILS}.RouterGatingLinearFunction"))
    expect("te_general_gemm is not None" in src,
           f"{MOE_UTILS}.RouterGatingLinearFunction no longer tests te_general_gemm")


def moe_expert_bias(get: Callable = original) -> None:
    fn = get(EXPERT_BIAS)
    expect(params(fn) == ["self", "routing_map", "padding_mask"], f"{EXPERT_BIAS} parameters")
    routing = torch.tensor([[True, False, True], [False, True, True]])
    router = types.SimpleNamespace(enable_expert_bias=True,
                                   local_tokens_per_expert=torch.zeros(3))
    with torch.enable_grad():
        fn(router, routing, None)
    expect(router.local_tokens_per_expert.tolist() == [1.0, 1.0, 2.0],
           f"{EXPERT_BIAS} no longer adds the routed tokens per expert")


def moe_permute(get: Callable = original) -> None:
    fn = get(PERMUTE)
    p = params(fn)
    expect(p == ["tokens", "routing_map", "probs", "num_out_tokens", "fused", "drop_and_pad"],
           f"{PERMUTE} parameters {p} (megatron-core >= 0.17 permutes without syncs itself)")
    routing = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    tokens, probs = torch.randn(4, 5, generator=_gen()), torch.rand(4, 3, generator=_gen())
    ours = get("models.layers.experts.sync_free.argsort_permute")
    theirs = fn(tokens, routing, probs=probs * routing, num_out_tokens=8)
    expect(len(theirs) == 3 and all(torch.equal(a, b) for a, b in
                                    zip(ours(tokens, routing, probs * routing, 8), theirs)),
           f"{PERMUTE}: the argsort order no longer equals masked_select's")


def moe_dispatcher(get: Callable = original) -> None:
    cls = get(A2A)
    expect(params(cls._maybe_dtoh_and_synchronize)[:3] == ["self", "point", "tokens_per_expert"]
           and params(cls.dispatch_postprocess) == ["self", "global_input_tokens", "global_probs"]
           and params(cls.combine_preprocess) == ["self", "hidden_states"],
           f"{A2A}: method parameters")
    post = flat_source(cls.dispatch_postprocess)
    expect('"before_finish", self.tokens_per_expert' in post
           and "self.tokens_per_expert = None" in post,
           f"{A2A}.dispatch_postprocess no longer hands back self.tokens_per_expert")
    fc1 = [name for name in ("token_dispatch", "dispatch_postprocess")
           if "linear_fc1_forward_and_act" in flat_source(getattr(cls, name))]
    expect(len(fc1) == 1, f"{A2A}: shared experts' fc1 runs in {fc1}, expected one of "
                          "token_dispatch / dispatch_postprocess")


def wgrad_fp32(get: Callable = original) -> None:
    src = flat_source(get(f"{TP_LAYERS}.LinearWithGradAccumulationAndAsyncCommunication"))
    expect(hasattr(get(TP_LAYERS), "_grad_accum_fusion_available")
           and "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(" in src,
           f"{TP_LAYERS}: no Apex fused_weight_gradient_mlp_cuda path in the linear's backward")


def quiet_tp_group_default(get: Callable = original) -> None:
    fn = get(GROUP_IF_NONE)
    expect(params(fn) == ["tp_group", "is_expert", "check_initialized"],
           f"{GROUP_IF_NONE} parameters {params(fn)}")
    for module in (TP_LAYERS, TP_MAPPINGS):
        expect(hasattr(get(module), "get_tensor_model_parallel_group_if_none"),
               f"{module} no longer imports get_tensor_model_parallel_group_if_none")
    linear = flat_source(get(f"{TP_LAYERS}.linear_with_grad_accumulation_and_async_allreduce"))
    expect("linear_with_grad_accumulation_and_async_allreduce.warned" in linear,
           f"{TP_LAYERS}: the linear's one-time advice no longer reads `.warned`")


def grad_norm(get: Callable = original) -> None:
    l2, scale = get("megatron.core.utils.local_multi_tensor_l2_norm"), \
        get("megatron.core.utils.local_multi_tensor_scale")
    expect(params(l2)[:4] == ["chunk_size", "noop_flag", "tensor_lists", "per_tensor"]
           and params(scale) == ["chunk_size", "noop_flag", "tensor_lists", "scale"],
           "megatron.core.utils local multi-tensor parameters")
    clip = get(CLIP)
    expect(hasattr(clip, "l2_norm_impl") and hasattr(clip, "multi_tensor_scale_impl"),
           f"{CLIP}: no l2_norm_impl / multi_tensor_scale_impl")
    # what l2_norm / scale reproduce on the device (megatron's local norm writes to "cuda")
    expect("torch.norm(tensor)" in flat_source(l2) and "torch.norm(torch.tensor(l2))"
           in flat_source(l2), "local_multi_tensor_l2_norm no longer takes the norm of the "
                               "per-tensor norms")
    expect("dst.copy_(src * scale)" in flat_source(scale),
           "local_multi_tensor_scale no longer writes src * scale into dst")


def async_writer_queue(get: Callable = original) -> None:
    module = get(ASYNC_FS)
    makers = [f for f in ("get_write_results_queue", "_get_write_results_queue")
              if hasattr(module, f)]
    expect(hasattr(module, "_results_queue") and makers
           and "if _results_queue is None:" in flat_source(getattr(module, makers[0])),
           f"{ASYNC_FS}: no module-level _results_queue made on first use")


def layer_wise_fp32(get: Callable = original) -> None:
    fn = get(LAYER_WISE).sharded_state_dict
    expect(params(fn)[:3] == ["self", "model_sharded_state_dict", "is_loading"],
           f"{LAYER_WISE}.sharded_state_dict parameters")
    expect("sd['optimizer']['state']" in flat_source(fn),
           f"{LAYER_WISE}.sharded_state_dict no longer reads the mixed-precision layout")


def muon_keywords(defs: Callable[[str], dict] = source_defs) -> None:
    """Static (megatron's Muon module is imported once, after the engine's typing shim)."""
    init = defs(MUON).get("TensorParallelMuon.__init__")
    expect(init is not None, f"{MUON}.TensorParallelMuon.__init__ not found")
    calls = [n for n in ast.walk(init) if isinstance(n, ast.Call)]
    keywords = {k.arg for c in calls for k in c.keywords}
    schulz = [c for c in calls if getattr(c.func, "id", None) == "newton_schulz_tp"]
    expect("use_nesterov" in keywords and schulz
           and all("mode" in {k.arg for k in c.keywords} for c in schulz),
           f"{MUON}: TensorParallelMuon no longer passes use_nesterov= / newton_schulz_tp mode=")


def mla_no_te(get: Callable = original) -> None:
    module = get(MLA)
    expect(hasattr(module, "HAVE_TE") and hasattr(module, "Linear"),
           f"{MLA}: no HAVE_TE / Linear")
    expect("HAVE_TE and isinstance(self.linear_proj, TELinear)" in flat_source(module),
           f"{MLA}: the TE-only linear_proj branch changed")


def cpu_runtime(defs: Callable[[str], dict] = source_defs) -> None:
    """Static (the CPU host runtime replaces these functions in place)."""
    found = defs(RANDOM)
    for name, first in (("_get_cuda_rng_state", "device"), ("_set_cuda_rng_state", "new_state")):
        fn = found.get(name)
        expect(fn is not None and fn.args.args and fn.args.args[0].arg == first,
               f"{RANDOM}.{name}: missing or its first parameter is not {first}")
    expect("disable_jit_fuser" in source_defs("megatron.core.jit"),
           "megatron.core.jit.disable_jit_fuser is gone")
