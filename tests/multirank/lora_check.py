"""Multi-rank LoRA SFT harness (launched by tests/test_lora_layouts.py).

    torchrun --nproc_per_node W tests/multirank/lora_check.py DENSE_DIR MOE_DIR ADAPTER OUT

DENSE_DIR / MOE_DIR: tiny HF models; ADAPTER: a PEFT adapter of DENSE_DIR (all-linear) every
dense run starts from; OUT: a folder shared by the launches. With
LORA_FAMILIES=NAME=DIR:ADAPTER:TARGETS[:EXTRA][;...] (tiny models of other families, each with
a PEFT adapter of it of TARGETS, comma-separated: GLM-4.5's and gpt-oss's attention, Qwen3.5's
attention, Gated DeltaNet and shared expert) their runs join: each one's reference at W == 1
(checkpoint OUT/ckpt_NAME), NAME_tp2+sp, NAME_pp2, NAME_ep2 and the EXTRA layouts
(comma-separated: cp2, cp2_packed: CP2 with the micro-batches packed, or ep2_wrong_expert,
the negative control of expert adapters loaded by
local instead of global expert index; `single`: no W == 2 runs) at W == 2. TARGETS are
model.lora.target_modules names as a run reads them on the family (all-linear, the MLP
names peft converts to the fused experts, `experts`, `router`), run on grouped experts; the
adapter's rank_pattern / alpha_pattern fill model.lora.* as a run from init_from does.

W == 1: the references. Dense: STEPS LoRA SFT steps (token-mean) from ADAPTER, saving a
training checkpoint after RESUME_AT steps (OUT/ckpt_resume) and after the last one
(OUT/ckpt_final); MoE (q/k/v/o + experts, SequentialMLP experts, fresh adapters): STEPS steps;
each family FAMILY_STEPS steps (checkpoint OUT/ckpt_NAME), as are its W == 2 runs.
Per-step losses and grad norms and the final adapter matrices go to OUT/ref.pt.
W == 2: the same runs at tp2+sp, pp2, dp2, cp2 (dense) and ep2 (MoE), a resume of
OUT/ckpt_resume at pp2 finishing the remaining steps, the negative controls "noreduce" (tp2
with the adapters' TP reductions switched off) and "tp2+sp_unsummed" (tp2+sp without the TP
sum of the gradients of the adapter matrices that see one sequence shard) and, when OUT/from_adapter exists (ADAPTER
converted by `tools/convert.py hf-to-mcore --adapter` at tp2), "from_mcore_pp2": the dense
run at pp2 with its adapters loaded from that checkpoint instead of ADAPTER. Rank 0 prints
one "RESULT {json}" per run with the largest relative differences to the reference (loss,
grad norm, adapter matrices); the dense tp2+sp, pp2 and resume_pp2 runs and every family's
ep2 run add the reference after a LoRA start (tests/multirank/lora_reference_check.py:
ref_gap, moved, and at tp2+sp base_gap).
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# GBS 4 (8 until 2026-11-26: the same bounds held, the world-2 launch took 45 s instead of
# 28 s); 3 steps: tp2+sp_unsummed's loss differs from step 2 on only (test_lora_layouts).
# The families' runs (about 3/4 of the world-2 launch) take 2: their PEFT adapters start with
# non-zero B, so a wrong layout shows in step 1's loss already, and step 2 is the first to use
# Adam's moments (3 until 2026-11-29)
STEPS, RESUME_AT, GBS, LR = 3, 2, 4, 1e-2
FAMILY_STEPS = 2
# Adam's eps well above the gradients' rounding noise: with 1e-8, elements whose gradient is
# ~0 move by +-lr on noise alone (tests/multirank/sft_invariance.py does the same)
ADAM_EPS = 1e-3
RANK, ALPHA = 4, 8.0
DENSE_TARGETS = ("all-linear",)
MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")


def batches(vocab: int, seed: int = 0, steps: int = STEPS):
    """`steps` global batches of GBS sequences (lengths 6..24, a trained suffix); the first
    ones are the same whatever `steps`."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        seqs = []
        for _ in range(GBS):
            n = rng.randint(6, 24)
            ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
            start = rng.randint(1, n - 1)
            seqs.append(SequenceData(ids[:-1], ids[1:], [0] * start + [1] * (n - start)))
        out.append(seqs)
    return out


def optim_cfg():
    return SimpleNamespace(lr=LR, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                           betas=[0.9, 0.95], eps=ADAM_EPS, schedule="constant",
                           distributed_optimizer=True)


def build(model_dir, hf_config, moe: bool, adapter: str | None, load: bool = True,
          overrides: dict | None = None, targets: tuple | None = None):
    import torch

    from engine.config.lora_settings import LoraConfig, lora_problems, lora_spec
    from engine.training.train_engine import TrainEngine

    targets = targets or (MOE_TARGETS if moe else DENSE_TARGETS)
    # model.lora.* as a run gives them: rank_pattern / alpha_pattern from the adapter
    cfg = SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(
        rank=RANK, alpha=ALPHA, target_modules=list(targets), init_from=adapter)), seed=7)
    problems = lora_problems(cfg, hf_config)
    assert not problems, problems
    spec = lora_spec(cfg, hf_config)
    overrides = dict(overrides or {})
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=overrides.pop("packing", False))
    extra = {"grouped_experts": False} if moe else {}
    return TrainEngine.build(hf_config, optim_cfg(), torch.float32, STEPS, train,
                             weights_dir=model_dir, load_weights=load, lora=spec,
                             lora_init=adapter, **extra, **(overrides or {}))


def adapter_tensors(engine) -> dict:
    """Full adapter matrices of this pipeline stage, keyed by megatron-independent names
    (experts included: keyed by layer / global expert through the sharded-state keys)."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    from models.bridge.checkpoint import model_sharded_state_dict

    out = {}
    for chunk_sd in model_sharded_state_dict(engine.chunks)["model"].values():
        for sh in chunk_sd.values():
            full = sh.data.detach()
            axis = [i for i, (s, g) in enumerate(zip(sh.local_shape, sh.global_shape[
                len(sh.global_shape) - len(sh.local_shape):])) if s != g]
            if axis and ps.get_tensor_model_parallel_world_size() > 1:
                parts = [full.clone() for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, full.contiguous(),
                                group=ps.get_tensor_model_parallel_group())
                full = __import__("torch").cat(parts, dim=axis[0])
            out[f"{sh.key}@{sh.global_offset[:len(sh.global_shape) - len(sh.local_shape)]}"] = \
                full.clone()
    return out


def train(engine, seqs_list, start: int = 0):
    from megatron.core import parallel_state as ps

    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer

    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    losses, norms = [], []
    for seqs in seqs_list[start:]:
        m = train_step(engine, seqs, normalizer)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    return losses, norms


def save(engine, root, step, hf_config, model_dir, targets=DENSE_TARGETS):
    from engine.checkpoint.checkpointing import DataPosition, save_training_checkpoint
    from models.lora.sites import lora_spec_of

    # what RunLoop stores: the run's keys (tools/convert.py reads model.lora.* and hf_path),
    # the rank / alpha patterns as filled from the adapter (JSON: a YAML flow mapping)
    spec = lora_spec_of(engine.chunks)
    yaml = (f"model:\n  hf_path: {model_dir}\n  lora:\n    rank: {RANK}\n    alpha: {ALPHA}\n"
            f"    target_modules: {list(targets)}\n"
            f"    rank_pattern: {json.dumps(spec.rank_pattern)}\n"
            f"    alpha_pattern: {json.dumps(spec.alpha_pattern)}\n")
    return str(save_training_checkpoint(engine, root, DataPosition(step, GBS, 100, 0, False),
                                        hf_config, model_dir, config_yaml=yaml))


def references(dense, moe, adapter, out):
    import torch

    data = batches(dense[1]["vocab_size"])
    engine = build(*dense, False, adapter)
    losses, norms = train(engine, data[:RESUME_AT])
    save(engine, os.path.join(out, "ckpt_resume"), RESUME_AT, dense[1], dense[0])
    more = train(engine, data, RESUME_AT)
    save(engine, os.path.join(out, "ckpt_final"), STEPS, dense[1], dense[0])
    ref = {"dense": {"loss": losses + more[0], "grad_norm": norms + more[1],
                     "params": adapter_tensors(engine)}}
    engine = build(*moe, True, None)
    losses, norms = train(engine, batches(moe[1]["vocab_size"]))
    ref["moe"] = {"loss": losses, "grad_norm": norms, "params": adapter_tensors(engine)}
    for name, model, family_adapter, targets, _ in other_families():
        engine = build(*model, False, family_adapter, targets=targets)
        losses, norms = train(engine, batches(model[1]["vocab_size"], steps=FAMILY_STEPS))
        save(engine, os.path.join(out, f"ckpt_{name}"), FAMILY_STEPS, model[1], model[0],
             targets)
        ref[name] = {"loss": losses, "grad_norm": norms, "params": adapter_tensors(engine)}
    torch.save(ref, os.path.join(out, "ref.pt"))
    print("RESULT " + json.dumps({"run": "reference", "dense_loss": ref["dense"]["loss"],
                                  "moe_loss": ref["moe"]["loss"],
                                  "refusals": loader_refusals(dense, adapter, out)}), flush=True)


def loader_refusals(dense, adapter, out) -> dict:
    """model.lora.init_from folders that are not exactly this model's adapters, each refused by
    models.lora.peft.load_peft_adapter naming the tensor: one with a B matrix removed, one with a
    tensor no target adapts (a layer's q_norm) added. {case: the refusal's message}."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.lora.sites import LoraUnsupportedError

    state = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    missing = next(k for k in sorted(state) if k.endswith("self_attn.o_proj.lora_B.weight"))
    extra = missing.replace("o_proj.lora_B", "q_norm.lora_A")
    cases = {"missing": {k: v for k, v in state.items() if k != missing},
             "extra": {**state, extra: state[missing.replace("lora_B", "lora_A")].clone()}}
    messages = {}
    for case, tensors in cases.items():
        folder = os.path.join(out, f"adapter_{case}")
        shutil.copytree(adapter, folder)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        try:
            build(*dense, False, folder)
            messages[case] = None
        except LoraUnsupportedError as e:
            messages[case] = str(e)
    return messages


def other_families() -> list:
    """[(name, (dir, HF config), adapter, targets, extra layouts)] of LORA_FAMILIES (module
    docstring)."""
    from models.hf.io import read_config

    out = []
    for item in filter(None, os.environ.get("LORA_FAMILIES", "").split(";")):
        name, _, paths = item.partition("=")
        path, adapter, targets, *extra = paths.split(":")
        out.append((name, (path, read_config(path)), adapter, tuple(targets.split(",")),
                    tuple(filter(None, ",".join(extra).split(",")))))
    return out


def compare(name, ref, losses, norms, params, start=0):
    import torch
    import torch.distributed as dist

    rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    worst, worst_key = 0.0, None
    for k, v in params.items():
        r = ref["params"][k]
        diff = float((v - r).abs().max()) / max(float(r.abs().max()), 1e-12)
        worst, worst_key = max((worst, worst_key), (diff, k), key=lambda t: t[0])
    box = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    count = torch.tensor([float(len(params))], dtype=torch.float64)
    dist.all_reduce(count)   # summed: the stages hold different adapters
    return {"run": name, "loss": losses, "loss_rel": rel(losses, ref["loss"][start:]),
            "grad_norm_rel": rel(norms, ref["grad_norm"][start:]),
            "param_rel": float(box[0]), "n_params": int(count[0]),
            "param_worst": (worst, worst_key)}   # this rank's (rank 0 prints it)


class Results(list):
    """Printed by rank 0 as they arrive ("RESULT {json}")."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def append(self, row: dict) -> None:
        super().append(row)
        if self.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)


def layouts(dense, moe, adapter, out, rank, world):
    import torch

    from tests.multirank import lora_reference_check as reference
    from tests.multirank.lora_controls import unsummed, wrong_expert
    from models.lora.sites import set_reduction
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from engine.checkpoint.checkpointing import load_training_checkpoint, DataPosition

    ref = torch.load(os.path.join(out, "ref.pt"))
    data = batches(dense[1]["vocab_size"])
    sp = (dict(tp=2, sequence_parallel=True), {"sequence_parallel": True})
    runs = [("tp2+sp", *sp, None), ("pp2", dict(pp=2), {}, None), ("dp2", {}, {}, None),
            ("cp2", dict(cp=2), {}, None), ("tp2+sp_unsummed", *sp, unsummed),
            ("noreduce", dict(tp=2), {}, lambda e: set_reduction(e.chunks, False))]
    results = Results(rank)
    starts = {}   # layout: the log-probs of the starting adapter (lora_reference_check)
    for name, layout, overrides, control in runs:
        setup_model_parallel(ParallelLayout(world, **layout))
        engine = build(*dense, False, adapter, overrides=overrides)
        if control is not None:   # a negative control
            control(engine)
        checked = name in ("tp2+sp", "pp2")
        if checked:
            starts[name] = reference.logprobs(engine, data[0])
        row = compare(name, ref["dense"], *train(engine, data), adapter_tensors(engine))
        if checked:
            row.update(reference.reference_report(engine, data[0], adapter, starts[name],
                                                  base=name == "tp2+sp"))
        results.append(row)
    converted = os.path.join(out, "from_adapter")
    if os.path.isdir(converted):   # tools/convert.py hf-to-mcore --adapter ADAPTER --tp 2
        from models.bridge.checkpoint import load_model

        setup_model_parallel(ParallelLayout(world, pp=2))
        engine = build(*dense, False, None,
                       overrides={"prepare": lambda raw: load_model(raw, converted)})
        results.append(compare("from_mcore_pp2", ref["dense"], *train(engine, data),
                               adapter_tensors(engine)))
    setup_model_parallel(ParallelLayout(world, pp=2))
    engine = build(*dense, False, None, load=False)
    load_training_checkpoint(engine, os.path.join(out, "ckpt_resume", f"iter_{RESUME_AT:07d}"),
                             DataPosition(0, GBS, 100, 0, False))
    row = compare("resume_pp2", ref["dense"], *train(engine, data, RESUME_AT),
                  adapter_tensors(engine), start=RESUME_AT)
    # resumed from a checkpoint: the reference is still the starting adapter (its folder)
    row.update(reference.reference_report(engine, data[0], adapter, starts["pp2"]))
    results.append(row)
    setup_model_parallel(ParallelLayout(world, ep=2))
    engine = build(*moe, True, None)
    results.append(compare("ep2", ref["moe"], *train(engine, batches(moe[1]["vocab_size"])),
                           adapter_tensors(engine)))
    extra_layouts = {"cp2": (dict(cp=2), {}, None),
                     "cp2_packed": (dict(cp=2), {"packing": True}, None),
                     "ep2_wrong_expert": (dict(ep=2), {}, wrong_expert)}
    for family, model, family_adapter, targets, extra in other_families():
        if "single" in extra:   # the reference only (world 1)
            continue
        family_data = batches(model[1]["vocab_size"], steps=FAMILY_STEPS)
        for name, layout, overrides, control in (
                ("tp2+sp", dict(tp=2), {"sequence_parallel": True}, None),
                ("pp2", dict(pp=2), {}, None), ("ep2", dict(ep=2), {}, None),
                *((x, *extra_layouts[x]) for x in extra)):
            setup_model_parallel(ParallelLayout(world, **layout))
            engine = build(*model, False, family_adapter, overrides=overrides, targets=targets)
            if control is not None:
                control(engine, family_adapter)
            checked = name == "ep2"   # experts over EP, routers, shared experts' gates
            start = reference.logprobs(engine, family_data[0]) if checked else None
            row = compare(f"{family}_{name}", ref[family], *train(engine, family_data),
                          adapter_tensors(engine))
            if checked:
                row.update(reference.reference_report(engine, family_data[0], family_adapter,
                                                      start))
            results.append(row)


def main():
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    dense_dir, moe_dir, adapter, out = sys.argv[1:5]
    rank, world = init_distributed()
    dense, moe = (dense_dir, read_config(dense_dir)), (moe_dir, read_config(moe_dir))
    if world == 1:
        setup_model_parallel(ParallelLayout(1))
        references(dense, moe, adapter, out)
    else:
        layouts(dense, moe, adapter, out, rank, world)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
