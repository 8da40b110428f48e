"""Multi-rank SFT invariance harness (launched by tests/test_sft_invariance.py).

    torchrun --nproc_per_node W tests/multirank/sft_invariance.py MODEL_DIR REF_FILE SPEC...

Each SPEC is "tp,pp,vpp,cp,mbs[,flags]" (flags: "+" separated: nobalance, packing, tokens=K;
sp: Megatron sequence parallelism; recompute=selective|full|block (full: uniform groups of 1
layer, block: full recompute of the first 1 layer per chunk); modes=A/B: only these aggregation
modes; bug=spnorm|detach|expertgrad: a deliberately broken run for a negative control, see
`inject_bug`; moe: train the MoE model of $INV_MOE_MODEL_DIR instead of MODEL_DIR; ep=E:
expert parallelism; aux=C: megatron's load-balancing loss `aux_loss` with coefficient C,
z=C: the router z-loss, both scaled per step by engine.training.router_losses; auxtype=T: the
load-balancing loss type (aux_loss, seq_aux_loss, global_aux_loss); cap=F: expert capacity
factor F (token dropping); the spec's results then carry the moe/* metrics);
ov: gradient-reduce and parameter-gather overlap on (engine.training.comm_overlap), with
bug=nogather (negative control) reading the final parameters without finishing the deferred
parameter all-gather. compile: train.compile=true (every transformer layer under torch.compile,
models.build.compile_layers; compared with the eager references); bug=attnscale (negative
control): the attention softmax scale 1 % off. lora: LoRA (rank 4, every linear layer, the
base frozen; references keyed "lora/MODE"). muon=MODE: optim.name=muon with
optim.muon.tp_mode=MODE (megatron-core's Muon, fp32 Newton-Schulz; references keyed
"muon/MODE", tests/multirank/muon_check.py); lw (with muon=MODE): Muon under megatron-core's
layer-wise distributed optimizer (optim.distributed_optimizer=true: each DP rank updates whole
parameters of its own, then all-gathers the rest); muonref (1 process): also advance a copy of
the parameters with the plain Muon + AdamW formulas (tests/muon_reference.py) and report
"muon_formula_rel" and "muon_grad_norm_rel".
For every spec and every aggregation mode it re-initialises megatron's parallel state in the
same processes, loads the same HF weights, trains 3 optimizer steps on fixed synthetic global
batches and records per-step loss, grad norm and the final parameters. With W == 1 and the
first spec, the results are the reference and are saved to REF_FILE; otherwise they are
compared with REF_FILE. Rank 0 prints one JSON line per (spec, mode), prefixed "RESULT ".
Negative controls reported on the same data: "mean_of_means" (per-micro-batch token means
averaged over micro-batches and DP ranks) and "dpcp_count" (token counts reduced over DP x CP).
INV_IMAGES=1: MODEL_DIR takes images (tests/qwen3_5_tiny.build_qwen3_5_vl) and the batches
hold images (tests/multirank/vision_batches.py), its vision tower trained; bug=mrope: packed
rows restart M-RoPE positions one token late (negative control); the two controls above are
not run (nor with INV_CONTROLS=0). The flag `oneimage`: batches where only the last sequence has images (references
keyed "NAME/oneimage/MODE"), so that micro-batches, and at DP2 all of one rank's, have none;
bug=notowerpass: text-only micro-batches skip the trained tower's zero pass
(models.vision.tower.zero_pass), which with `ov` fails in megatron's finish_grad_sync: the
spec's result is then {"error": message} and the launch goes on.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm")
STEPS, GBS, HORIZON = 3, 16, 48
LR = 1e-2
ADAM_EPS = float(os.environ.get("INV_ADAM_EPS", "1e-4"))
IMAGES = os.environ.get("INV_IMAGES") == "1"
# the chunked loss head (train.loss_chunk_tokens) with chunks of 16 tokens: every micro-batch
# of every layout spans several chunks, the last one ragged
LOSS_CHUNK_TOKENS = 16
MOE_METRICS: list[dict] = []  # the moe/* and mtp/* metrics of each step of the latest run_layout
MUON_FORMULA: dict = {}  # flag muonref: the latest run_layout's differences from the formulas


def synthetic_batches(vocab: int, seed: int = 0):
    """STEPS global batches of GBS sequences: lengths 6..40, a random trained suffix; the
    first sequence of each batch has no trained token (exercises empty sequences)."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(seed)
    batches = []
    for _ in range(STEPS):
        seqs = []
        for i in range(GBS):
            n = rng.randint(6, 40)
            ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
            start = n if i == 0 else rng.randint(1, n - 1)
            mask = [0] * start + [1] * (n - start)
            seqs.append(SequenceData(ids[:-1], ids[1:], mask))
        batches.append(seqs)
    return batches


def parse_spec(spec: str):
    parts = spec.split(",")
    tp, pp, vpp, cp, mbs = (int(x) for x in parts[:5])
    flags = parts[5].split("+") if len(parts) > 5 and parts[5] else []
    tokens = next((int(f.split("=")[1]) for f in flags if f.startswith("tokens=")), None)
    ep = next((int(f.split("=")[1]) for f in flags if f.startswith("ep=")), 1)
    train = SimpleNamespace(micro_batch_size=mbs, max_tokens_per_micro_batch=tokens,
                            balance_dp="nobalance" not in flags, packing="packing" in flags)
    return dict(tp=tp, pp=pp, vpp=vpp or None, cp=cp, ep=ep), train


def spec_model(spec: str, dense: tuple) -> tuple:
    """(model dir, HF config, reference-key prefix) of a spec: the dense MODEL_DIR, or with
    the `moe` flag the MoE model of $INV_MOE_MODEL_DIR (its references are keyed "moe/MODE"),
    or with `m=NAME` the model $INV_MODEL_DIRS (a JSON object) names NAME ("NAME/MODE")."""
    from models.hf.io import read_config

    parts = spec.split(",")
    flags = parts[5].split("+") if len(parts) > 5 else []
    other = next((f.split("=")[1] for f in flags if f.startswith("m=")), None)
    if other is not None:   # m=NAME: the model $INV_MODEL_DIRS (JSON) names NAME
        path = json.loads(os.environ["INV_MODEL_DIRS"])[other]
        return path, read_config(path), other + "/"
    if "moe" not in flags:
        return (*dense, "")
    moe_dir = os.environ["INV_MOE_MODEL_DIR"]
    return moe_dir, read_config(moe_dir), "moe/"


def moe_loss_overrides(spec: str) -> dict:
    """TransformerConfig fields of the `aux=C`, `z=C` and `cap=F` flags (engine.config.moe_settings'
    mapping: moe.aux_loss_coeff, moe.z_loss_coeff, moe.capacity_factor)."""
    from engine.config.moe_settings import MoEConfig, moe_overrides

    parts = spec.split(",")
    flags = parts[5].split("+") if len(parts) > 5 else []
    value = {f.split("=")[0]: float(f.split("=")[1]) for f in flags
             if f.split("=")[0] in ("aux", "z", "cap")}
    if not value:
        return {}
    aux_type = next((f.split("=")[1] for f in flags if f.startswith("auxtype=")), "aux_loss")
    cfg = SimpleNamespace(moe=MoEConfig(aux_loss_coeff=value.get("aux"),
                                        z_loss_coeff=value.get("z"),
                                        capacity_factor=value.get("cap"),
                                        aux_loss_type=aux_type))
    return moe_overrides(cfg, {"model_type": "qwen3_moe"})


def lora_overrides(spec: str, hf_config: dict) -> dict:
    """The flag `lora`: LoRA rank 4, alpha 8 on every linear layer (model.lora.* through the
    engine's own mapping, engine.config.lora_family), the base frozen; references keyed
    "lora/MODE"."""
    from engine.config.lora_family import family_spec

    flags = spec.split(",")[5].split("+") if spec.count(",") >= 5 else []
    if "lora" not in flags:
        return {}
    return {"lora": family_spec(hf_config, 4, 8.0, ["all-linear"], False, {}, {}, 0.0, 0)}


def spec_options(spec: str) -> dict:
    """The spec's model settings (megatron TransformerConfig overrides, through the engine's
    own mapping), aggregation modes and injected bug."""
    from engine.config.model_settings import megatron_overrides

    parts = spec.split(",")
    flags = parts[5].split("+") if len(parts) > 5 and parts[5] else []
    value = {f.split("=")[0]: f.split("=")[1] for f in flags if "=" in f}
    kind = value.get("recompute", "none")
    train = SimpleNamespace(recompute="full" if kind == "block" else kind,
                            recompute_method="block" if kind == "block" else None,
                            recompute_num_layers=None)
    parallel = SimpleNamespace(tp=int(parts[0]), sequence_parallel="sp" in flags)
    modes = tuple(value["modes"].split("/")) if "modes" in value else MODES
    overrides = megatron_overrides(parallel, train)
    if "compile" in flags:   # train.compile=true (models.build.compile_layers)
        overrides["compile_layers"] = True
    return dict(overrides=overrides, modes=modes,
                bug=value.get("bug"), overlap=overlap_of(flags),
                muon=value.get("muon") or ("duplicated" if "muonref" in flags else None),
                muonref="muonref" in flags, muon_layer_wise="lw" in flags,
                fused="fused" in flags)


def overlap_of(flags: list[str]):
    """OverlapSettings of the `ov` flag (both overlaps on, small buckets so that several
    reductions overlap the backward pass), else None (the engine's default: off)."""
    from engine.training.comm_overlap import OverlapSettings

    if "ov" not in flags:
        return None
    return OverlapSettings(overlap_grad_reduce=True, overlap_param_gather=True, bucket_mb=0.02)


def inject_bug(state, bug: str | None):
    """Negative controls. spnorm: the norm weights lose their `sequence_parallel` tag, so
    finalize_model_grads does not sum their sequence-sliced gradients over TP (the classic SP
    bug). detach: recomputed layers get a detached input (reentrant checkpointing then
    produces no gradient for anything inside or before them: the classic recompute bug).
    nolwgather: Muon's layer-wise distributed optimizer skips the all-gather after its update,
    so each rank keeps stale copies of the parameters other ranks own. Returns an undo
    function."""
    import torch
    from megatron.core import tensor_parallel

    if bug == "spnorm":
        for chunk in state.chunks:
            for p in chunk.parameters():
                if getattr(p, "sequence_parallel", False):
                    p.sequence_parallel = False
        return lambda: None
    if bug == "detach":
        original = tensor_parallel.checkpoint

        def detached(function, distribute, *args):
            return original(function, distribute,
                            *[a.detach() if isinstance(a, torch.Tensor) else a for a in args])

        tensor_parallel.checkpoint = detached
        return lambda: setattr(tensor_parallel, "checkpoint", original)
    if bug == "expertgrad":
        return average_expert_grads(state)
    if bug == "attnscale":  # the attention scale off by 1 % (relative)
        for chunk in state.chunks:
            for module in chunk.modules():
                if type(module).__name__ == "SDPACoreAttention":
                    module.scale *= 1.01
        return lambda: None
    if bug == "nogather":  # handled by run_layout: parameters read before the gather
        return lambda: None
    if bug == "nolwgather":   # Muon's layer-wise optimizer without its parameter all-gather
        optimizer = state.optimizer
        optimizer.allgather_params = lambda: None
        return lambda: optimizer.__dict__.pop("allgather_params", None)
    if bug == "mrope":
        from tests.multirank.vision_batches import misplaced_restarts
        return misplaced_restarts()
    if bug == "notowerpass":
        from models.vision.model import VisionLanguageModel
        original = VisionLanguageModel._tower_needs_zero_pass
        VisionLanguageModel._tower_needs_zero_pass = lambda self: False
        return lambda: setattr(VisionLanguageModel, "_tower_needs_zero_pass", original)
    assert bug is None, bug
    return lambda: None


def average_expert_grads(state):
    """Negative control for expert parallelism: after megatron's gradient reduction, expert
    gradients are divided by the expert-data-parallel size, i.e. averaged over the
    expert-DP group instead of summed (the classic "DDP averages" bug, on expert weights only:
    they reduce over dp x cp / ep ranks, not over dp x cp). Returns an undo function."""
    from megatron.core import parallel_state as ps

    config = state.chunks[0].config
    original = config.finalize_model_grads_func
    size = ps.get_expert_data_parallel_world_size()

    def finalize(model, *args, **kwargs):
        original(model, *args, **kwargs)
        for chunk in model:
            for p in chunk.parameters():
                if not getattr(p, "allreduce", True):
                    p.main_grad.div_(size)

    config.finalize_model_grads_func = finalize
    return lambda: setattr(config, "finalize_model_grads_func", original)


def run_layout(model_dir, hf_config, train, mode, batches, overrides=None, bug=None,
               overlap=None, muon=None, muonref=False, muon_layer_wise=False, fused=False):
    """3 steps from the HF weights under the current parallel state (set up once per layout:
    creating megatron's process groups is the slowest part of a gloo launch)."""
    import torch
    from megatron.core import parallel_state as ps

    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.bridge.weights import export_hf_weights

    optim = SimpleNamespace(lr=LR, min_lr=0.0, warmup_steps=0, weight_decay=0.01,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=ADAM_EPS, schedule="constant",
                            distributed_optimizer=True)
    from tests.multirank.muon_check import FormulaCheck, check_step, muon_optim
    optim = muon_optim(optim, muon, layer_wise=muon_layer_wise) if muon else optim
    optim.fused = True if fused else None   # torch's fused AdamW (engine.training.fused_adamw)
    vision = {"train_vision": True} if IMAGES else {}
    state = TrainEngine.build(hf_config, optim, torch.float32, STEPS, train,
                              weights_dir=model_dir, overlap=overlap,
                              loss_chunk_tokens=LOSS_CHUNK_TOKENS, **(overrides or {}), **vision)
    if fused:   # the flag reached every torch AdamW of megatron's optimizer
        from engine.training.fused_adamw import torch_adams
        adams = torch_adams(state.optimizer)
        assert adams and all(g["fused"] for o in adams for g in o.param_groups), "not fused"
    normalizer = GlobalLossNormalizer(mode, HORIZON, True, group=ps.get_data_parallel_group())
    check = FormulaCheck(state, optim) if muonref else None
    losses, norms = [], []
    undo = inject_bug(state, bug)
    try:
        for seqs in batches:
            m = train_step(state, seqs, normalizer)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
            check_step(check, m["grad_norm"])
            MOE_METRICS.append({k: v for k, v in m.items() if k.startswith(("moe/", "mtp/"))})
    finally:
        undo()
    if check is not None:
        MUON_FORMULA.update(muon_formula_rel=check.rel, muon_grad_norm_rel=check.norm_rel)
    if bug != "nogather":
        state.gather_params()
    params = {k: v.clone() for k, v in export_hf_weights(state.chunks, hf_config)}
    state.release()   # freed with this layout's process groups when the next one starts
    return losses, norms, params


def param_diff(params, ref_params, select=lambda name: True):
    """Max abs difference over this stage's tensors whose HF name `select` accepts, relative
    to the max abs reference value of each tensor."""
    worst = 0.0
    for k, v in params.items():
        if not select(k):
            continue
        ref = ref_params[k]
        worst = max(worst, float((v - ref).abs().max()) / max(float(ref.abs().max()), 1e-12))
    return worst


def is_token_embedding(name: str) -> bool:
    """The input token embedding (HF name `...embed_tokens.weight`): results also report its
    param_rel apart ("param_rel_embedding", the rest "param_rel_other"), for tests that bound
    it separately (tests/test_vlm.py says why)."""
    return name.endswith("embed_tokens.weight")


def negative_controls(model_dir, hf_config, batches, world):
    """Losses of the two classic bugs on the first batch at this layout (DP=world, mbs=3)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.sft.training import sft_loss_fn
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import reduce_reports, run_micro_batches
    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(world))
    optim = SimpleNamespace(lr=1e-2, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    train = SimpleNamespace(micro_batch_size=3, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    state = TrainEngine.build(hf_config, optim, torch.float32, 1, train, weights_dir=model_dir)
    # mean of means: per micro-batch token mean, / GA, averaged over DP
    unit = GlobalLossNormalizer("token-sum", group=ps.get_data_parallel_group())
    batch = build_rank_batch(batches[0], unit, train)
    with torch.no_grad():
        reports = run_micro_batches(state.chunks, batch.micro_batches,
                                    sft_loss_fn(state.vocab_size), forward_only=True)
    local = sum(float(r["loss"]) / max(float(r["num_loss_tokens"]), 1.0) for r in reports)
    local = torch.tensor([local / len(reports)], dtype=torch.float64)
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    mean_of_means = float(local) / ps.get_data_parallel_world_size()
    # SP-duplicate bug: count tokens over DP x CP from unsharded masks (each CP rank holds the
    # same sequences): the loss of token-mean drops to 1/cp of the reference.
    cp = world if world in (2, 8) else 2
    setup_model_parallel(ParallelLayout(world, cp=cp))
    state = TrainEngine.build(hf_config, optim, torch.float32, 1, train, weights_dir=model_dir)
    dup = GlobalLossNormalizer("token-mean",
                               group=ps.get_data_parallel_group(with_context_parallel=True))
    batch = build_rank_batch(batches[0], dup, train)
    with torch.no_grad():
        reports = run_micro_batches(state.chunks, batch.micro_batches,
                                    sft_loss_fn(state.vocab_size), forward_only=True)
    dpcp = reduce_reports(reports, ["loss"])["loss"]
    return {"mean_of_means": mean_of_means, "dpcp_count": dpcp, "cp": cp}


def spec_key(spec: str, dense: tuple) -> str:
    """The reference key prefix of a spec: its model's, then "oneimage/", then "muon/"."""
    flags = spec.split(",")[5].split("+") if spec.count(",") >= 5 else []
    return (spec_model(spec, dense)[2] + ("oneimage/" if "oneimage" in flags else "")
            + ("lora/" if "lora" in flags else "")
            + ("muon/" if any(f.startswith(("muon=", "muonref")) for f in flags) else ""))


def harness_models(root: str) -> tuple[str, str]:
    """(dense, MoE) tiny HF model folders under `root` for this harness's launches (the MoE one
    goes in INV_MOE_MODEL_DIR): Qwen3 and Qwen3-MoE (2 layers), vocabulary 200,
    initializer_range 0.4 so that per-token losses differ a lot at init (loss ~10 vs log 200 =
    5.3) and aggregation bugs move the loss far beyond the tolerance (a near-uniform model would
    give every token the same loss and hide them)."""
    from tools.tiny_models import build_tiny_model

    dense = build_tiny_model(os.path.join(root, "model"), "qwen3", vocab_size=200,
                             initializer_range=0.4, tokenizer=False)
    moe = build_tiny_model(os.path.join(root, "moe"), "qwen3_moe", vocab_size=200, layers=2,
                           initializer_range=0.4, tokenizer=False)
    return dense, moe


def main():
    import torch
    import torch.distributed as dist

    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    model_dir, ref_file, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, world = init_distributed()
    hf_config = read_config(model_dir)
    dense = (model_dir, hf_config)
    if IMAGES:
        from tests.multirank.vision_batches import vision_batches
        batches = vision_batches(hf_config, STEPS, GBS)
        one_image = vision_batches(hf_config, STEPS, GBS, image_rows=1)
    else:
        batches, one_image = synthetic_batches(hf_config["vocab_size"]), None
    making_ref = world == 1 and not os.path.exists(ref_file)
    ref = None if making_ref else torch.load(ref_file)
    new_ref = {}
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    for i, spec in enumerate(specs):
        layout_kw, train = parse_spec(spec)
        spec_dir, spec_config, _ = spec_model(spec, dense)
        key = spec_key(spec, dense)
        data = one_image if "oneimage" in spec else batches
        first_of_model = all(spec_key(s, dense) != key for s in specs[:i])
        opts = spec_options(spec)
        opts["overrides"].update(moe_loss_overrides(spec))
        opts["overrides"].update(lora_overrides(spec, spec_config))
        setup_started = time.perf_counter()
        setup_model_parallel(ParallelLayout(world, **layout_kw))
        setup_s = round(time.perf_counter() - setup_started, 2)
        for mode in opts["modes"]:
            MOE_METRICS.clear()
            MUON_FORMULA.clear()
            started = time.perf_counter()
            try:
                losses, norms, params = run_layout(spec_dir, spec_config, train, mode, data,
                                                   opts["overrides"], opts["bug"],
                                                   opts["overlap"], opts["muon"],
                                                   opts["muonref"], opts["muon_layer_wise"],
                                                   opts["fused"])
            except AssertionError as e:   # bug=notowerpass: the crash it stands for
                if opts["bug"] != "notowerpass":
                    raise
                if rank == 0:
                    print("RESULT " + json.dumps({"spec": spec, "mode": mode, "error": str(e)}),
                          flush=True)
                continue
            if making_ref and first_of_model:
                new_ref[key + mode] = {"loss": losses, "grad_norm": norms, "params": params}
                out = {"spec": spec, "mode": mode, "world": world, "reference": True,
                       "loss": losses, "grad_norm": norms}
            else:
                r = (new_ref or ref)[key + mode]
                rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
                pdiff = torch.tensor([param_diff(params, r["params"], sel) for sel in (
                    lambda k: True, is_token_embedding, lambda k: not is_token_embedding(k))],
                    dtype=torch.float64)
                dist.all_reduce(pdiff, op=dist.ReduceOp.MAX)
                out = {"spec": spec, "mode": mode, "world": world, "loss": losses,
                       "loss_rel": rel(losses, r["loss"]), "grad_norm": norms,
                       "grad_norm_rel": rel(norms, r["grad_norm"]),
                       "param_rel": float(pdiff[0]), "param_rel_embedding": float(pdiff[1]),
                       "param_rel_other": float(pdiff[2]), "n_params": len(params)}
            out.update(MUON_FORMULA)
            if any(MOE_METRICS):
                out["moe"] = list(MOE_METRICS)
            out["seconds"] = round(time.perf_counter() - started, 2)
            out["setup_s"], setup_s = setup_s, 0.0  # process groups, once per spec
            if rank == 0:
                print("RESULT " + json.dumps(out), flush=True)
    if making_ref:
        torch.save(new_ref, ref_file)
    if world > 1 and not IMAGES and os.environ.get("INV_CONTROLS", "1") == "1":
        controls = negative_controls(model_dir, hf_config, batches, world)
        if rank == 0:
            controls.update(world=world, reference_loss=(ref or new_ref)["token-mean"]["loss"][0])
            print("CONTROL " + json.dumps(controls), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
