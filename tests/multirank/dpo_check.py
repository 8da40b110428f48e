"""DPO layout harness (run on the session's rank pools by tests/test_dpo.py).

`layouts(policy_dir, reference_dir, specs, adapter)` runs on every rank of a pool. Each spec is
"tp,pp,vpp,cp,mbs[,flags]" (flags "+" separated: sp, packing, tokens=K (token-budget
micro-batches), lora (the policy is `adapter` on the policy model, the reference that
starting adapter frozen, engine.preference.reference), baseref (with lora: the reference is the bare
base with the adapters off, the engine's reference before issue 67: a negative control),
loss=T, ls=EPS, rpo=ALPHA, bug=localmean|cpsum|mbnll (negative controls, `inject_bug`);
kto: a KTO run on unpaired examples instead (tests/multirank/kto_check.py: its flags and its
negative control bug=mbkl); muon: optim.name=muon (megatron-core's Muon, tests/multirank/
muon_check.py)).
For every spec it sets up megatron's layout in the same processes, loads the same HF weights,
trains STEPS optimizer steps of engine.dpo.training.dpo_step on the same pair batches and
returns (rank 0; None elsewhere) {spec: {"loss": [...], "grad_norm": [...], metric: [...],
"params": {name: tensor}}} (orpo specs also ORPO_METRICS) at world size 1 (the references, saved to a file), else each spec's
relative differences to its reference (`compare`).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

STEPS, PAIRS, SEQ_LENGTH = 2, 8, 64
LR, ADAM_EPS = 1e-2, 1e-4
LOSS_CHUNK_TOKENS = 16
RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected", "nll", "logits/chosen",
           "logits/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")   # TRL's ORPOTrainer names


def metrics_of(spec: str) -> tuple[str, ...]:
    """The metrics a spec records and compares."""
    from tests.multirank import kto_check

    if "kto" in flags_of(spec):
        return kto_check.METRICS
    return METRICS + (ORPO_METRICS if flags_of(spec).get("loss") == "orpo" else ())


def pair_batches(vocab: int, seed: int = 0) -> list[list]:
    """STEPS batches of PAIRS pairs: a shared prompt of 3..14 tokens, sides of 2..24 completion
    tokens (the last pair's chosen side 30: sides of very different lengths)."""
    from engine.data.datasets import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(STEPS):
        batch = []
        for k in range(PAIRS):
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 14))]
            sides = []
            for length in (30 if k == PAIRS - 1 else rng.randint(2, 24), rng.randint(2, 24)):
                ids = prompt + [rng.randrange(4, vocab) for _ in range(length)]
                mask = [0] * (len(prompt) - 1) + [1] * length
                sides.append(Sample(ids[:-1], ids[1:], mask))
            batch.append(SimpleNamespace(chosen=sides[0], rejected=sides[1], margin=None))
        out.append(batch)
    return out


def flags_of(spec: str) -> dict:
    parts = spec.split(",")
    flags = parts[5].split("+") if len(parts) > 5 and parts[5] else []
    return {f.split("=")[0]: (f.split("=", 1)[1] if "=" in f else True) for f in flags}


def run_cfg(flags: dict):
    """The keys engine.dpo.training.dpo_step reads."""
    return SimpleNamespace(
        dpo=SimpleNamespace(loss_type=flags.get("loss", "sigmoid"), beta=0.5,
                            label_smoothing=float(flags.get("ls", 0.0)),
                            rpo_alpha=float(flags["rpo"]) if "rpo" in flags else None,
                            simpo_gamma=0.5),
        loss=SimpleNamespace(agg_mode="token-mean", norm_horizon=None,
                             count_empty_sequences=True),
        train=SimpleNamespace(seq_length=SEQ_LENGTH))


def optim_cfg(flags: dict | None = None):
    """AdamW, or with the flag `muon` megatron-core's Muon (tests/multirank/muon_check.py)."""
    from tests.multirank.muon_check import muon_optim

    optim = SimpleNamespace(lr=LR, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=ADAM_EPS, schedule="constant",
                            distributed_optimizer=True)
    return muon_optim(optim) if flags and "muon" in flags else optim


def build(spec: str, policy_dir: str, reference_dir: str, adapter: str | None):
    """(policy engine, engine.preference.reference.Reference) at the spec's layout (set up
    here)."""
    import torch

    from engine.config.lora_settings import LoraConfig, lora_spec
    from engine.config.model_settings import megatron_overrides
    from engine.dpo.pair_loss import REFERENCE_FREE
    from engine.preference.reference import Reference
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    import torch.distributed as dist

    tp, pp, vpp, cp, mbs = (int(x) for x in spec.split(",")[:5])
    flags = flags_of(spec)
    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, cp=cp,
                                        vpp=vpp or None, sequence_parallel="sp" in flags))
    hf_config = read_config(policy_dir)
    train = SimpleNamespace(micro_batch_size=mbs, balance_dp=True, packing="packing" in flags,
                            max_tokens_per_micro_batch=int(flags["tokens"])
                            if "tokens" in flags else None)
    overrides = megatron_overrides(SimpleNamespace(tp=tp, sequence_parallel="sp" in flags),
                                   SimpleNamespace(recompute="none", recompute_method=None,
                                                   recompute_num_layers=None))
    lora = {}
    if "lora" in flags:
        cfg = SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(
            rank=RANK, alpha=ALPHA, target_modules=list(TARGETS), init_from=adapter)), seed=7)
        lora = dict(lora=lora_spec(cfg, hf_config), lora_init=adapter)
    policy = TrainEngine.build(hf_config, optim_cfg(flags), torch.float32, STEPS, train,
                               weights_dir=policy_dir, loss_chunk_tokens=LOSS_CHUNK_TOKENS,
                               **overrides, **lora)
    needed = flags.get("loss", "sigmoid") not in REFERENCE_FREE
    frozen = None
    if needed and not lora:
        frozen = TrainEngine.frozen(hf_config, torch.float32, reference_dir, train, 0,
                                    loss_chunk_tokens=LOSS_CHUNK_TOKENS, **overrides)
    start = adapter if lora and "baseref" not in flags else None
    return policy, Reference(policy, frozen, bool(lora), needed, start), hf_config


def inject_bug(bug: str | None, micro_batches: int = 1):
    """Negative controls; returns an undo function. localmean: every DP rank divides by its
    OWN pair count (the DP mean of per-rank means, the classic DP bug). cpsum: the per-sequence
    log-prob sums are not summed over CP (each CP rank uses its shard's sum). mbnll (orpo): the
    NLL is each micro-batch's own token mean over its chosen tokens, divided by the step's
    `micro_batches` (DP x GA; TRL's convention under gradient accumulation and DP)."""
    import engine.dpo.loss_fn as loss_fn
    from megatron.core import parallel_state as ps

    if bug == "mbnll":
        original_nll = loss_fn.sequence_nll

        def micro_batch_mean(logp, seq_ids, weights):
            ids = seq_ids.long()
            chosen = ((ids >= 0) & (ids % 2 == 0)).to(logp.dtype)
            return -(logp * chosen).sum() / chosen.sum().clamp(min=1) / micro_batches

        loss_fn.sequence_nll = micro_batch_mean
        return lambda: setattr(loss_fn, "sequence_nll", original_nll)
    if bug == "localmean":
        original = loss_fn.PairBatch.num_pairs
        dp = ps.get_data_parallel_world_size()
        loss_fn.PairBatch.num_pairs = property(lambda self: self.counts.numel() // 2 // dp)
        return lambda: setattr(loss_fn.PairBatch, "num_pairs", original)
    if bug == "cpsum":   # sums of this shard only; which sequences are present stays right
        original = loss_fn.sequence_table

        def shard_sums(logp, mask, seq_ids, size):
            import torch.distributed as dist

            import engine.preference.table as core

            group, core.cp_group = core.cp_group, lambda: None
            try:
                table = original(logp, mask, seq_ids, size)
            finally:
                core.cp_group = group
            counts = table[:, 1].contiguous()
            dist.all_reduce(counts, group=group())
            table[:, 1] = counts
            return table

        loss_fn.sequence_table = shard_sums
        return lambda: setattr(loss_fn, "sequence_table", original)
    assert bug is None, bug
    return lambda: None


def _dpo_steps(policy, reference, spec: str, vocab: int) -> dict:
    from engine.dpo.training import dpo_step

    flags = flags_of(spec)
    cfg = run_cfg(flags)
    out = {k: [] for k in metrics_of(spec)}
    undo = inject_bug(flags.get("bug"), PAIRS // int(spec.split(",")[4]))
    try:
        for pairs in pair_batches(vocab):
            m = dpo_step(policy, reference, pairs, cfg)
            for k in out:
                out[k].append(m[k])
    finally:
        undo()
    return out


def run_spec(spec: str, policy_dir: str, reference_dir: str, adapter: str | None) -> dict:
    from engine.training.nonfinite import NonFiniteGuard
    from models.bridge.weights import export_hf_weights
    from tests.multirank.lora_check import adapter_tensors

    from tests.multirank import kto_check

    policy, reference, hf_config = build(spec, policy_dir, reference_dir, adapter)
    policy.guard = NonFiniteGuard(3)
    flags = flags_of(spec)
    if "kto" in flags:
        out = kto_check.run_steps(policy, reference, flags, hf_config["vocab_size"])
    else:
        out = _dpo_steps(policy, reference, spec, hf_config["vocab_size"])
    policy.gather_params()
    if "lora" in flags:
        out["params"] = adapter_tensors(policy)
    else:
        out["params"] = {k: v.clone() for k, v in export_hf_weights(policy.chunks, hf_config)}
    policy.release()
    if reference.engine is not None:
        reference.engine.release()
    return out


def reference_key(spec: str) -> str:
    """The single-process run a spec is compared with: its loss flags (and lora)."""
    flags = flags_of(spec)
    return "+".join(f"{k}={flags[k]}" if flags[k] is not True else k
                    for k in ("lora", "baseref", "kto", "dw", "uw", "loss", "ls", "rpo", "muon")
                    if k in flags) or "sigmoid"


def compare(result: dict, ref: dict) -> dict:
    """Relative differences to the single process: per metric, the max over steps of |diff|
    over the metric's scale (its largest |value| over the steps, at least 1e-2: rewards pass
    near 0), and the parameters (max over tensors of max |diff| / max |ref|, the max over
    ranks: each holds its own stage)."""
    import torch
    import torch.distributed as dist

    from tests.multirank import kto_check

    out = {}
    for k in dict.fromkeys(METRICS + ORPO_METRICS + kto_check.METRICS):
        if k not in ref:
            continue
        out[k] = result[k]
        scale = max(max(abs(b) for b in ref[k]), 1e-2)
        out[f"{k}_rel"] = max(abs(a - b) / scale for a, b in zip(result[k], ref[k]))
    worst = max((float((v - ref["params"][k]).abs().max())
                 / max(float(ref["params"][k].abs().max()), 1e-12)
                 for k, v in result["params"].items()), default=0.0)
    box = torch.tensor([worst, float(len(result["params"]))], dtype=torch.float64)
    dist.all_reduce(box[:1], op=dist.ReduceOp.MAX)
    out["param_rel"] = float(box[0])
    return out


def layouts(policy_dir: str, reference_dir: str, specs: list[str], ref_file: str,
            adapter: str | None = None) -> dict | None:
    """At world size 1: run `specs` and save their results (parameters included) to
    `ref_file`, keyed by reference_key. Else: run them and compare with `ref_file`. Returns
    (rank 0) {spec: compare(...)}."""
    import torch
    import torch.distributed as dist

    single = dist.get_world_size() == 1
    refs = {} if single else torch.load(ref_file)
    results = {}
    for spec in specs:
        got = run_spec(spec, policy_dir, reference_dir, adapter)
        if single:
            refs[reference_key(spec)] = got
            results[spec] = {k: got[k] for k in metrics_of(spec)}
        else:
            results[spec] = compare(got, refs[reference_key(spec)])
    if single:
        torch.save(refs, ref_file)
    return results if dist.get_rank() == 0 else None


def _micro_batch(seq_ids: list[int], vocab: int = 11):
    import torch

    g = torch.Generator().manual_seed(0)
    n = len(seq_ids)
    return SimpleNamespace(labels=torch.randint(0, vocab, (1, n), generator=g),
                           loss_mask=torch.ones(1, n), seq_ids=torch.tensor([seq_ids]),
                           token_weights=torch.zeros(1, n)), torch.randn(1, n, vocab,
                                                                         generator=g)


def loss_fn_checks() -> dict:
    """One rank (megatron state set up for tp = 1): the loss function on hand-made micro-batches
    (tests/test_dpo_units.py asserts). split_error: the message for a micro-batch holding pair
    1's chosen side only; grad_*: autograd through the micro-batch loss vs through the ipo pair
    loss of the summed log-probs (two whole pairs, vocabulary 11); loss / want: its value."""
    import torch

    from engine.dpo.loss_fn import PairBatch, dpo_loss_fn
    from engine.dpo.pair_loss import PairLossSettings, pair_terms
    from engine.training.token_losses import token_logprobs
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(1))
    out = {}
    batch = PairBatch(PairLossSettings("sigmoid"), torch.full((4,), 3.0),
                      torch.zeros(4, dtype=torch.float64))
    mb, logits = _micro_batch([0, 0, 0, 1, 1, 1, 2, 2, 2])
    try:
        dpo_loss_fn(batch, 11)(logits, mb)
        out["split_error"] = ""
    except RuntimeError as e:
        out["split_error"] = str(e)
    s = PairLossSettings("ipo", beta=0.2)
    ids = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    ref = torch.tensor([-8.0, -6.0, -9.0, -2.0], dtype=torch.float64)
    counts = torch.tensor([3.0, 2.0, 4.0, 1.0], dtype=torch.float64)
    mb, logits = _micro_batch(ids)
    leaf = logits.clone().requires_grad_()
    loss, reports = dpo_loss_fn(PairBatch(s, counts, ref), 11)(leaf, mb)
    loss.backward()
    direct = logits.clone().requires_grad_()
    logp = token_logprobs(direct, mb.labels.clone(), 11)[0]
    sums = torch.stack([logp[torch.tensor(ids) == i].sum() for i in range(4)]).double()
    want = pair_terms(s, sums[0::2], sums[1::2], ref[0::2], ref[1::2], counts[0::2],
                      counts[1::2]).loss.mean()
    want.backward()
    out.update(grad_max_diff=float((leaf.grad - direct.grad).abs().max()),
               grad_max=float(direct.grad.abs().max()), loss=float(reports["loss"]),
               want=float(want))
    return out
