"""Reward-model layout harness (run on the session's rank pools by tests/test_rm.py).

`layouts(dirs, specs, ref_file, adapter)` runs on every rank of a pool. Each spec is
"tp,pp,vpp,cp,mbs[,flags]" (flags "+" separated: sp, packing, tokens=K, lora (adapters from
`adapter` on the body, the head trained in full), margin (odd pairs carry a margin), center=C
(rm.center_rewards_coefficient), seqcls (start from the sequence-classification folder, not
the causal LM plus a seeded row: the same numbers), moe (the Qwen3-MoE model), ep=E, muon
(optim.name=muon, as dpo_check), bug=localmean|cpsum (negative controls)). Pairs and the compare rule are tests/multirank/
dpo_check's; each spec trains STEPS steps of engine.rm.training.rm_step and returns (rank 0)
its metrics and final parameters (score row included) at world size 1, else its relative
differences to the single process.
"""
from __future__ import annotations

from types import SimpleNamespace

from tests.multirank import dpo_check

STEPS, PAIRS = dpo_check.STEPS, dpo_check.PAIRS
INIT_STD, SEED = 0.5, 7
METRICS = ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward",
           "max_reward", "rewards/chosen", "rewards/rejected")
TAIL = 4   # an untrained id after a side's last trained token (ChatML's "\n" after <|im_end|>)
flags_of = dpo_check.flags_of


def batches(vocab: int, flags: dict) -> list[list]:
    """dpo_check's pair batches, every side followed by 1 (chosen) or 2 (rejected) untrained
    TAIL ids, as ChatML renders `<|im_end|>\n` (the reward model reads a side up to its last
    trained token: engine.rm.training.scored_ids); with `margin`, odd pairs get margin
    0.25 * k."""
    from engine.data.datasets import Sample

    out = dpo_check.pair_batches(vocab)
    for batch in out:
        for pair in batch:
            for name, n in (("chosen", 1), ("rejected", 2)):
                s = getattr(pair, name)
                ids = list(s.tokens) + [s.labels[-1]] + [TAIL] * n
                setattr(pair, name, Sample(ids[:-1], ids[1:], list(s.loss_mask) + [0] * n))
    if "margin" in flags:
        for batch in out:
            for k, pair in enumerate(batch):
                pair.margin = 0.25 * k if k % 2 else None
    return out


def run_cfg(flags: dict, model_dir: str):
    """The keys engine.rm.training reads."""
    from engine.config.rm_settings import RMSettings

    center = float(flags["center"]) if "center" in flags else None
    return SimpleNamespace(rm=RMSettings(init_std=None if "seqcls" in flags else INIT_STD,
                                         center_rewards_coefficient=center),
                           model=SimpleNamespace(hf_path=model_dir), seed=SEED)


def build(spec: str, dirs: dict, adapter: str | None):
    """(engine, hf_config, cfg) at the spec's layout (set up here)."""
    import torch
    import torch.distributed as dist

    from engine.config.lora_settings import LoraConfig, lora_spec
    from engine.config.model_settings import megatron_overrides
    from engine.rm.training import score_head_setup
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    tp, pp, vpp, cp, mbs = (int(x) for x in spec.split(",")[:5])
    flags = flags_of(spec)
    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, cp=cp,
                                        vpp=vpp or None, ep=int(flags.get("ep", 1)),
                                        sequence_parallel="sp" in flags))
    model_dir = dirs["moe" if "moe" in flags else "seqcls" if "seqcls" in flags else "causal"]
    hf_config = read_config(model_dir)
    cfg = run_cfg(flags, model_dir)
    train = SimpleNamespace(micro_batch_size=mbs, balance_dp=True, packing="packing" in flags,
                            max_tokens_per_micro_batch=int(flags["tokens"])
                            if "tokens" in flags else None)
    overrides = megatron_overrides(SimpleNamespace(tp=tp, sequence_parallel="sp" in flags),
                                   SimpleNamespace(recompute="none", recompute_method=None,
                                                   recompute_num_layers=None))
    lora = {}
    if "lora" in flags:
        lcfg = SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(
            rank=dpo_check.RANK, alpha=dpo_check.ALPHA, target_modules=list(dpo_check.TARGETS),
            init_from=adapter)), seed=SEED)
        lora = dict(lora=lora_spec(lcfg, hf_config), lora_init=adapter)
    reader, prepare = score_head_setup(cfg, hf_config)
    engine = TrainEngine.build(hf_config, dpo_check.optim_cfg(flags), torch.float32, STEPS, train,
                               weights_dir=model_dir, reader=reader, prepare=prepare,
                               loss_chunk_tokens=dpo_check.LOSS_CHUNK_TOKENS, **overrides,
                               **lora)
    return engine, hf_config, cfg


def inject_bug(bug: str | None):
    """Negative controls; returns an undo function. localmean: every DP rank divides by its
    OWN pair count. cpsum: a sequence's score is not summed over CP (the CP ranks without its
    last token score it 0)."""
    import engine.rm.loss_fn as loss_fn
    from megatron.core import parallel_state as ps

    if bug == "localmean":
        original = loss_fn.RewardBatch.num_pairs
        dp = ps.get_data_parallel_world_size()
        loss_fn.RewardBatch.num_pairs = property(lambda self: self.margins.numel() // dp)
        return lambda: setattr(loss_fn.RewardBatch, "num_pairs", original)
    if bug == "cpsum":
        import engine.preference.table as dpo_loss_fn

        group = dpo_loss_fn.cp_group

        def shard_table(values, mask, seq_ids, size):
            import torch.distributed as dist

            dpo_loss_fn.cp_group = lambda: None
            try:
                table = original(values, mask, seq_ids, size)
            finally:
                dpo_loss_fn.cp_group = group
            counts = table[:, 1].contiguous()
            dist.all_reduce(counts, group=group())
            table[:, 1] = counts
            return table

        original = loss_fn.sequence_table
        loss_fn.sequence_table = shard_table
        return lambda: setattr(loss_fn, "sequence_table", original)
    assert bug is None, bug
    return lambda: None


def run_spec(spec: str, dirs: dict, adapter: str | None) -> dict:
    from engine.rm.training import rm_step
    from engine.training.nonfinite import NonFiniteGuard
    from models.bridge.reward_model import export_reward_model
    from tests.multirank.lora_check import adapter_tensors

    engine, hf_config, cfg = build(spec, dirs, adapter)
    engine.guard = NonFiniteGuard(3)
    flags = flags_of(spec)
    out = {k: [] for k in METRICS}
    undo = inject_bug(flags.get("bug"))
    try:
        for pairs in batches(hf_config["vocab_size"], flags):
            m = rm_step(engine, pairs, cfg)
            for k in METRICS:
                out[k].append(m[k])
    finally:
        undo()
    engine.gather_params()
    params = {k: v.clone() for k, v in export_reward_model(engine.chunks, hf_config)}
    if "lora" in flags:
        params = {**adapter_tensors(engine), **{k: v for k, v in params.items()
                                                if k == "score.weight"}}
    out["params"] = params
    engine.release()
    return out


def reference_key(spec: str) -> str:
    """The single-process run a spec is compared with (seqcls starts equal the causal run)."""
    flags = flags_of(spec)
    return "+".join(f"{k}={flags[k]}" if flags[k] is not True else k
                    for k in ("lora", "moe", "margin", "center", "muon") if k in flags) or "base"


def layouts(dirs: dict, specs: list[str], ref_file: str, adapter: str | None = None
            ) -> dict | None:
    """As dpo_check.layouts: at world size 1 save the references, else compare with them."""
    import torch
    import torch.distributed as dist

    single = dist.get_world_size() == 1
    refs = {} if single else torch.load(ref_file)
    results = {}
    for spec in specs:
        got = run_spec(spec, dirs, adapter)
        if single and reference_key(spec) not in refs:
            refs[reference_key(spec)] = got
            results[spec] = {k: got[k] for k in METRICS}
        else:
            results[spec] = compare(got, refs[reference_key(spec)])
    if single:
        torch.save(refs, ref_file)
    return results if dist.get_rank() == 0 else None


def compare(result: dict, ref: dict) -> dict:
    """dpo_check.compare over this harness's metrics."""
    saved = dpo_check.METRICS
    dpo_check.METRICS = METRICS
    try:
        return dpo_check.compare(result, ref)
    finally:
        dpo_check.METRICS = saved
