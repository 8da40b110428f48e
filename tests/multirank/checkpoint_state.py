"""Round trip of a training checkpoint inside one launch (tests/test_checkpointing.py).

    torchrun --nproc_per_node W tests/multirank/checkpoint_state.py MODEL_DIR OUT_DIR

At the launched world size (data parallel), builds a TrainState from MODEL_DIR, trains 2 steps,
saves a checkpoint with engine.checkpoint.checkpointing, records the optimizer state (fp32 master weights
and Adam moments of every local parameter), the scheduler state and fresh draws of every RNG;
then scrambles all of them, builds a second TrainState without weights, loads the checkpoint
and compares. Also checks the refusals: a different global batch size (ResumeMismatchError) and
a model-only checkpoint (CheckpointError). Rank 0 prints one line "RESULT {json}".
Then the gradient-reduce/parameter-gather overlap (engine.training.comm_overlap) both ways: a
checkpoint saved with both overlaps on (the parameters' other DP shards still deferred to the
next forward) resumes with them off, and one saved with them off resumes with them on; rank 0
prints "OVERLAP {json}" with whether the resumed parameters and next-step losses are equal.
Then optim.name=muon (megatron-core's Muon + AdamW, tests/multirank/muon_check.py): 2 steps,
save, resume into a fresh state; rank 0 prints "MUON {json}": whether every optimizer state
tensor (Muon's momentum buffers, Adam's moments) and parameter is bitwise equal, and the next
step's losses and grad norms of both; then the same under megatron-core's layer-wise
distributed optimizer (optim.distributed_optimizer=true with Muon), its checkpoint also resumed
at TP2 x DP1, rank 0 printing "MUONLW {json}". Before Muon, optim.fused=true (torch's fused
AdamW): saved, resumed fused and resumed unfused; rank 0 prints "FUSED {json}" (state bitwise
equal after the fused resume, the next steps' losses, which implementation each run used).
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GBS = 8
# Adam with warmup + cosine, distributed optimizer; 2-sequence micro-batches
OPTIM = SimpleNamespace(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.01, clip_grad=1.0,
                        betas=[0.9, 0.95], eps=1e-8, schedule="cosine",
                        distributed_optimizer=True)
TRAIN = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None, balance_dp=True,
                        packing=False)


def batches(vocab: int, steps: int):
    from engine.training.micro_batches import SequenceData

    rng = random.Random(0)
    out = []
    for _ in range(steps):
        seqs = []
        for _ in range(GBS):
            n = rng.randint(6, 20)
            ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
            seqs.append(SequenceData(ids[:-1], ids[1:], [0] * 2 + [1] * (n - 2)))
        out.append(seqs)
    return out


def _digest(t) -> str:
    import hashlib
    return hashlib.sha1(t.cpu().numpy().tobytes()).hexdigest()


def rng_fingerprint() -> list:
    """One draw of python, numpy and torch CPU RNGs, and digests of the CUDA (stand-in) RNG
    and of megatron's tracker states."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return [random.random(), float(np.random.rand()), float(torch.rand(1)[0]),
            _digest(torch.cuda.get_rng_state()),
            {k: _digest(v) for k, v in sorted(tracker.items())}]


def optimizer_tensors(optimizer) -> list:
    """Every local fp32 master shard and Adam moment, in a fixed order."""
    out = []
    for opt in optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                out += [p.detach().clone(), state["exp_avg"].clone(),
                        state["exp_avg_sq"].clone(), float(state["step"])]
    return out


def overlap_round_trip(hf: dict, model_dir: str, root: str, save_on: bool) -> dict:
    """Train 2 steps with the overlaps `save_on`, save, resume with the opposite setting;
    compare the exported parameters (after gather_params) and the next step's loss."""
    import torch
    from megatron.core import parallel_state as ps

    from engine.checkpoint.checkpointing import (DataPosition, load_training_checkpoint,
                                                 save_training_checkpoint)
    from engine.sft.training import train_step
    from engine.training.comm_overlap import OverlapSettings
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.bridge.weights import export_hf_weights

    on, off = OverlapSettings(True, True, bucket_mb=0.02), OverlapSettings()
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    saved = TrainEngine.build(hf, OPTIM, torch.float32, 6, TRAIN, weights_dir=model_dir,
                              overlap=on if save_on else off)
    for seqs in batches(hf["vocab_size"], 2):
        train_step(saved, seqs, normalizer)
    path = save_training_checkpoint(saved, root, DataPosition(2, GBS, 100, 7, True), hf,
                                    model_dir)
    resumed = TrainEngine.build(hf, OPTIM, torch.float32, 6, TRAIN, weights_dir=model_dir,
                                load_weights=False, overlap=off if save_on else on)
    load_training_checkpoint(resumed, path, DataPosition(0, GBS, 100, 7, True))
    for s in (saved, resumed):
        s.gather_params()
    want = dict(export_hf_weights(saved.chunks, hf))
    got = dict(export_hf_weights(resumed.chunks, hf))
    params_equal = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    nxt = batches(hf["vocab_size"], 3)[2]
    return {"save_overlap": save_on, "params_equal": params_equal,
            "loss_next": [train_step(saved, nxt, normalizer)["loss"],
                          train_step(resumed, nxt, normalizer)["loss"]]}


def saved_after_two_steps(hf: dict, optim, model_dir: str, root: str):
    """(state, checkpoint path, token-mean normalizer): 2 steps of `optim` from the HF weights,
    then a training checkpoint under `root`."""
    import torch
    from megatron.core import parallel_state as ps

    from engine.checkpoint.checkpointing import DataPosition, save_training_checkpoint
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine

    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    saved = TrainEngine.build(hf, optim, torch.float32, 6, TRAIN, weights_dir=model_dir)
    for seqs in batches(hf["vocab_size"], 2):
        train_step(saved, seqs, normalizer)
    path = save_training_checkpoint(saved, root, DataPosition(2, GBS, 100, 7, True), hf,
                                    model_dir)
    return saved, path, normalizer


def resumed_from(hf: dict, optim, model_dir: str, path: str):
    """A fresh state of `optim` (no weights loaded) with the checkpoint at `path` loaded."""
    import torch

    from engine.checkpoint.checkpointing import DataPosition, load_training_checkpoint
    from engine.training.train_engine import TrainEngine

    state = TrainEngine.build(hf, optim, torch.float32, 6, TRAIN, weights_dir=model_dir,
                              load_weights=False)
    load_training_checkpoint(state, path, DataPosition(0, GBS, 100, 7, True))
    return state


def fused_round_trip(hf: dict, model_dir: str, root: str) -> dict:
    """optim.fused=true (torch's fused AdamW, engine.training.fused_adamw): 2 steps, save,
    resume fused (every master shard, Adam moment and step counter bitwise equal, the next
    step identical) and resume unfused (the resumed run's own setting: foreach AdamW, the next
    step within fp32 rounding of the fused one)."""
    import torch

    from engine.sft.training import train_step
    from engine.training.fused_adamw import torch_adams

    fused, foreach = (SimpleNamespace(**{**vars(OPTIM), "fused": f}) for f in (True, False))
    saved, path, normalizer = saved_after_two_steps(hf, fused, model_dir, root)
    runs = [resumed_from(hf, optim, model_dir, path) for optim in (fused, foreach)]
    want, got = (optimizer_tensors(s.optimizer) for s in (saved, runs[0]))
    equal = len(want) == len(got) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(want, got))
    flag = torch.tensor([0 if equal else 1])
    torch.distributed.all_reduce(flag)
    nxt, after = batches(hf["vocab_size"], 4)[2:]
    steps = [train_step(s, nxt, normalizer) for s in (saved, *runs)]
    later = [train_step(s, after, normalizer) for s in (saved, *runs)]  # after the resumed step
    return {"state_equal": int(flag) == 0, "n_state_tensors": len(want),
            "loss_after": [m["loss"] for m in later],
            "fused": [all(g["fused"] for o in torch_adams(s.optimizer) for g in o.param_groups)
                      for s in (saved, *runs)],
            "loss_next": [m["loss"] for m in steps],
            "grad_norm_next": [m["grad_norm"] for m in steps]}


def optimizer_state_tensors(optimizer) -> list:
    """Every state tensor of every chained optimizer (any optimizer kind), in a fixed order."""
    import torch

    out = []
    for opt in optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out += [v.clone() for _, v in sorted(opt.optimizer.state[p].items())
                        if isinstance(v, torch.Tensor)]
    return out


def muon_round_trip(hf: dict, model_dir: str, root: str, layer_wise: bool = False) -> dict:
    """optim.name=muon: 2 steps, save, resume into a fresh state, compare (module docstring);
    `layer_wise`: under megatron-core's layer-wise distributed optimizer, where each rank
    saves the state of the parameters it owns, then also resumed at TP2 (DP1): see
    `muon_relayout`."""
    import torch

    from engine.sft.training import train_step
    from tests.multirank.muon_check import muon_optim

    optim = muon_optim(OPTIM, layer_wise=layer_wise)
    saved, path, normalizer = saved_after_two_steps(hf, optim, model_dir, root)
    resumed = resumed_from(hf, optim, model_dir, path)
    want, got = (optimizer_state_tensors(s.optimizer) for s in (saved, resumed))
    equal = len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    flag = torch.tensor([0 if equal else 1])
    torch.distributed.all_reduce(flag)
    nxt = batches(hf["vocab_size"], 3)[2]
    steps = [train_step(s, nxt, normalizer) for s in (saved, resumed)]
    relayout = muon_relayout(hf, model_dir, path, optim, nxt) if layer_wise else {}
    return {**relayout, "state_equal": int(flag) == 0, "n_state_tensors": len(want),
            "momentum_buffers": sum("momentum_buffer" in o.optimizer.state[p]
                                    for o in saved.optimizer.chained_optimizers
                                    for g in o.optimizer.param_groups for p in g["params"]),
            "loss_next": [m["loss"] for m in steps], "grad_norm_next": [m["grad_norm"]
                                                                       for m in steps]}


def muon_relayout(hf: dict, model_dir: str, path: str, optim, nxt) -> dict:
    """The layer-wise Muon checkpoint at `path` (saved at DP2) resumed at TP2 x DP1 (the
    layout-invariant tp_mode): the next step's loss and grad norm there ("relayout_next")."""
    import torch
    from megatron.core import parallel_state as ps

    from engine.checkpoint.checkpointing import DataPosition, load_training_checkpoint
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(torch.distributed.get_world_size(), tp=2))
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    state = TrainEngine.build(hf, optim, torch.float32, 6, TRAIN, weights_dir=model_dir,
                              load_weights=False)
    load_training_checkpoint(state, path, DataPosition(0, GBS, 100, 7, True))
    m = train_step(state, nxt, normalizer)
    return {"relayout_next": [m["loss"], m["grad_norm"]]}


def main() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.checkpoint.checkpointing import (CheckpointError, DataPosition, ResumeMismatchError,
                                                 load_training_checkpoint, save_training_checkpoint)
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    model_dir, out_dir = sys.argv[1], sys.argv[2]
    rank, world = init_distributed()
    setup_model_parallel(ParallelLayout(world))
    hf = read_config(model_dir)
    optim, train = OPTIM, TRAIN
    state = TrainEngine.build(hf, optim, torch.float32, 6, train, weights_dir=model_dir)
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    for seqs in batches(hf["vocab_size"], 2):
        train_step(state, seqs, normalizer)
    position = DataPosition(2, GBS, 100, 7, True)
    root = os.path.join(out_dir, "run")
    path = save_training_checkpoint(state, root, position, hf, model_dir)
    want_opt = optimizer_tensors(state.optimizer)
    want_sched = state.scheduler.state_dict()
    want_lr = state.optimizer.param_groups[0]["lr"]
    want_rng = rng_fingerprint()
    # scramble every RNG and build a fresh state without weights
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    setup_model_parallel(ParallelLayout(world), seed=4321)
    fresh = TrainEngine.build(hf, optim, torch.float32, 6, train, weights_dir=model_dir,
                              load_weights=False)
    got_position = load_training_checkpoint(fresh, path, DataPosition(0, GBS, 100, 7, True))
    got_rng = rng_fingerprint()
    got_opt = optimizer_tensors(fresh.optimizer)
    got_sched = fresh.scheduler.state_dict()
    got_lr = fresh.optimizer.param_groups[0]["lr"]
    opt_equal = len(got_opt) == len(want_opt) and all(
        (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        for a, b in zip(got_opt, want_opt))
    # the next step of both states is identical
    nxt = batches(hf["vocab_size"], 3)[2]
    loss_a = train_step(state, nxt, normalizer)["loss"]
    loss_b = train_step(fresh, nxt, normalizer)["loss"]
    errors = {}
    try:
        load_training_checkpoint(fresh, path, DataPosition(0, GBS * 2, 100, 7, True))
    except ResumeMismatchError as e:
        errors["gbs"] = str(e)
    model_only = os.path.join(out_dir, "model_only")
    save_checkpoint(model_sharded_state_dict(state.chunks), model_only, hf, model_dir)
    try:
        load_training_checkpoint(fresh, model_only, position)
    except CheckpointError as e:
        errors["model_only"] = str(e)
    flag = torch.tensor([0 if opt_equal else 1])
    dist.all_reduce(flag)
    if rank == 0:
        print("RESULT " + json.dumps({
            "position": got_position.__dict__, "opt_equal": int(flag) == 0,
            "n_opt_tensors": len(want_opt), "sched": [want_sched, got_sched],
            "lr": [want_lr, got_lr],
            "rng": [want_rng, got_rng], "loss_next": [loss_a, loss_b], "errors": errors}),
            flush=True)
    trips = [overlap_round_trip(hf, model_dir, os.path.join(out_dir, f"overlap_{on}"), on)
             for on in (True, False)]
    equal = torch.tensor([sum(not t["params_equal"] for t in trips)])
    dist.all_reduce(equal)
    if rank == 0:
        print("OVERLAP " + json.dumps({"trips": trips, "all_params_equal": int(equal) == 0}),
              flush=True)
    fused = fused_round_trip(hf, model_dir, os.path.join(out_dir, "fused"))
    if rank == 0:
        print("FUSED " + json.dumps(fused), flush=True)
    from tests.multirank.muon_check import MUON_RUNS
    if MUON_RUNS:
        muon = muon_round_trip(hf, model_dir, os.path.join(out_dir, "muon"))
        layer_wise = muon_round_trip(hf, model_dir, os.path.join(out_dir, "muon_lw"), True)
        if rank == 0:
            print("MUON " + json.dumps(muon), flush=True)
            print("MUONLW " + json.dumps(layer_wise), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
