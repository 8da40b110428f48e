"""Measure the bytes each rank hands to collectives in one optimizer step, by kind, and print
them next to models.estimate.comm's prediction (launched by tests/test_comm_plan.py).

    torchrun --nproc_per_node 2 tests/multirank/comm_bytes.py DENSE_DIR MOE_DIR SPEC...

SPEC: "name:tp,pp,vpp,cp,ep,sp,moe[,lora]" (sp, moe: 0/1; lora: a LoRA rank on all-linear,
the base frozen; absent or 0: full fine-tuning). Before torch.distributed is used (and
before megatron binds module-level aliases of its functions), every collective and
point-to-point function of torch.distributed is wrapped: the outermost call records (group,
op, input bytes) as models.estimate.comm defines them (all-gather: the local input;
reduce-scatter and all-reduce: the input; all-to-all: the input chunks; p2p: sends only).
Calls made inside a wrapped call (parallel.cpu_runtime's gloo stand-ins) are not counted
again. For each spec the harness builds the engine under that layout with both overlaps on,
trains one unrecorded step, then records the second (which includes the deferred parameter
all-gather of the first step's update, as every steady-state step does), attributes each call
to a kind by its process group and op, and rank 0 prints one "RESULT {json}" line per spec
with every rank's measured and predicted bytes.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RECORDS: list[tuple] = []      # (group, op, bytes) of the recorded window
_STATE = threading.local()
_RECORDING = {"on": False}
SEQ, GBS = 32, 8
SENDS = {"send", "isend"}
RECVS = {"recv", "irecv"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _input_bytes(op: str, args, kwargs) -> int:
    """Input bytes of a call (module docstring)."""
    if op in ("all_reduce", "broadcast", "send", "isend"):
        return _nbytes(args[0] if args else kwargs.get("tensor"))
    if op in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor")))
    if op in ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
              "all_to_all_single"):
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list",
                                                                 kwargs.get("input")))
    return 0


def _wrap(op: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_STATE, "depth", 0)
        if depth == 0 and _RECORDING["on"] and op not in RECVS:
            if op == "batch_isend_irecv":
                for p2p in args[0]:
                    if p2p.op in (dist.isend, dist.send) or "send" in getattr(p2p.op, "__name__",
                                                                               ""):
                        RECORDS.append((p2p.group, "isend", _nbytes(p2p.tensor)))
            else:
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                RECORDS.append((group, op, _input_bytes(op, args, kwargs)))
        _STATE.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.depth = depth

    return wrapper


def install_wrappers() -> None:
    for op in ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "broadcast"):
        if hasattr(dist, op):
            setattr(dist, op, _wrap(op, getattr(dist, op)))


install_wrappers()   # before megatron (and parallel.cpu_runtime) import torch.distributed names


def group_kinds() -> dict:
    """{id(group): role} of megatron's groups in the current parallel state."""
    from megatron.core import parallel_state as ps

    roles = [("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
             ("cp", ps.get_context_parallel_group),
             ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
             ("edp", ps.get_expert_data_parallel_group), ("ep", ps.get_expert_model_parallel_group),
             ("etp", ps.get_expert_tensor_parallel_group),
             ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
             ("emb", ps.get_embedding_group)]
    out = {}
    for role, getter in roles:
        try:
            g = getter()
        except (AssertionError, RuntimeError):
            continue
        out.setdefault(id(g), role)
    return out


def attribute(records: list[tuple]) -> dict[str, float]:
    """Measured bytes by comm_plan kind (calls over one-rank groups dropped; all-reduces over
    the DP/PP/world groups are control scalars; every send is a pipeline send: megatron passes
    its own group object, not always parallel_state's)."""
    roles = group_kinds()
    out: dict[str, float] = {}
    for group, op, nbytes in records:
        if group is not None and dist.get_world_size(group) == 1:
            continue
        role = roles.get(id(group), "world") if group is not None else "world"
        kind = None
        if role in ("dp", "edp") and (op.startswith("reduce_scatter")
                                      or op == "_reduce_scatter_base"):
            kind = "dp_grad_reduce"
        elif role in ("dp", "edp") and op in ("all_gather_into_tensor", "_all_gather_base"):
            kind = "dp_param_all_gather"
        elif role in ("tp", "etp"):
            kind = "tp_sp"
        elif op in SENDS:   # the pipeline schedule is the only p2p user inside a step
            kind = "pp_p2p"
        elif role == "emb" and op == "all_reduce":
            kind = "pp_tied_embedding"
        elif role == "cp":
            kind = "cp_exchange"
        elif role in ("ep", "tp_ep") and op.startswith("all_to_all"):
            kind = "ep_all_to_all"
        key = kind or f"other:{role}:{op}"
        out[key] = out.get(key, 0.0) + nbytes
    return out


def batches(vocab: int):
    from engine.training.micro_batches import SequenceData

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        seqs = []
        for _ in range(GBS):
            ids = torch.randint(4, vocab, (SEQ + 1,), generator=gen).tolist()
            seqs.append(SequenceData(ids[:-1], ids[1:], [0] * 4 + [1] * (SEQ - 4)))
        out.append(seqs)
    return out


def lora_spec_of_rank(hf: dict, rank: int):
    """model.lora.* of rank `rank` (alpha 2 rank) on all-linear, as a run resolves it."""
    from types import SimpleNamespace

    from engine.config.lora_settings import LoraConfig, lora_spec

    cfg = SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(
        rank=rank, alpha=2.0 * rank, target_modules=["all-linear"])), seed=7)
    return lora_spec(cfg, hf)


def run_spec(spec: str, dense_dir: str, moe_dir: str) -> dict:
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from models.estimate.comm import CommSetup, comm_plan
    from engine.config.model_settings import megatron_overrides
    from engine.sft.training import train_step
    from engine.training.comm_overlap import OverlapSettings
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    name, sizes = spec.split(":")
    tp, pp, vpp, cp, ep, sp, moe, rank = (int(x) for x in (sizes + ",0").split(",")[:8])
    model_dir = moe_dir if moe else dense_dir
    hf = read_config(model_dir)
    layout = ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, vpp=vpp or None, cp=cp, ep=ep,
                            sequence_parallel=bool(sp))
    setup_model_parallel(layout)
    mbs = 2
    train = SimpleNamespace(micro_batch_size=mbs, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    overrides = megatron_overrides(SimpleNamespace(tp=tp, sequence_parallel=bool(sp)),
                                   SimpleNamespace(recompute="none", recompute_method=None,
                                                   recompute_num_layers=None))
    lora = lora_spec_of_rank(hf, rank) if rank else None
    state = TrainEngine.build(hf, optim, torch.float32, 4, train, weights_dir=model_dir,
                              overlap=OverlapSettings(True, True), lora=lora, **overrides)
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    first, second = batches(hf["vocab_size"])
    train_step(state, first, normalizer)
    RECORDS.clear()
    _RECORDING["on"] = True
    try:
        train_step(state, second, normalizer)
    finally:
        _RECORDING["on"] = False
    measured = attribute(RECORDS)
    micro_batches = GBS // layout.dp // mbs
    plan = comm_plan(hf, layout, CommSetup(tokens_per_micro_batch=mbs * SEQ,
                                           micro_batches=micro_batches, act_bytes=4,
                                           lora=lora))
    predicted = plan.stages[ps.get_pipeline_model_parallel_rank()]
    return {"spec": name, "rank": dist.get_rank(), "measured": measured, "predicted": predicted}


def main():
    from parallel.process_groups import init_distributed, shutdown

    dense_dir, moe_dir, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, world = init_distributed()
    for spec in specs:
        mine = run_spec(spec, dense_dir, moe_dir)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            print("RESULT " + json.dumps({"spec": mine["spec"], "ranks": everyone}), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
