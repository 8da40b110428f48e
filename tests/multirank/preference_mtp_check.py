"""KTO and DPO with the MTP layer trained (model.mtp.enabled; issue 76 item 3), run on one rank
of the session's pool by tests/test_mtp.py: engine.kto.training.kto_step, then
engine.dpo.training.dpo_step, on a model with a complete MTP layer, attached, loss_scale 0.5,
token-mean; the reference is a stub whose completion log-prob sums are 0 (the MTP targets do
not read it)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

MTP_SCALE, LR = 0.5, 1e-2


def kto_trains_the_mtp_layer(model_dir: str) -> dict:
    """Two kto_steps: batch 1 of tests.multirank.kto_check.example_batches (5 desirable, 3
    undesirable examples), then the same examples all undesirable; then one dpo_step on batch 1
    of tests.multirank.dpo_check.pair_batches. Returns per step the metrics' keys, mtp/loss
    and the largest change of any MTP parameter in that step, and for the KTO steps the MTP
    weights of each batch (engine.kto.training.mtp_weights)."""
    import torch

    from engine.dpo.training import dpo_step
    from engine.kto.training import example_batch, kto_step, mtp_weights
    from engine.training.mtp import MTPTraining
    from engine.training.nonfinite import NonFiniteGuard
    from engine.training.train_engine import TrainEngine
    from parallel.wrappers import unwrap
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from tests.multirank import dpo_check
    from tests.multirank.kto_check import example_batches, run_cfg

    setup_model_parallel(ParallelLayout(1))
    hf = read_config(model_dir)
    optim = SimpleNamespace(lr=LR, min_lr=0.0, warmup_steps=0, weight_decay=0.0, clip_grad=1.0,
                            betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=False)
    train = SimpleNamespace(micro_batch_size=4, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    engine = TrainEngine.build(hf, optim, torch.float32, 2, train, weights_dir=model_dir,
                               loss_chunk_tokens=8, mtp=MTPTraining(MTP_SCALE, False))
    engine.guard = NonFiniteGuard(3)
    reference = SimpleNamespace(sums=lambda seqs, units: torch.zeros(len(seqs),
                                                                     dtype=torch.float64))
    cfg = run_cfg({})
    cfg.loss = SimpleNamespace(agg_mode="token-mean", norm_horizon=None,
                               count_empty_sequences=True)
    mixed = example_batches(hf["vocab_size"])[0]
    rejected = [replace(e, label=False) for e in mixed]
    model = unwrap(engine.chunks[0])

    def step(run) -> dict:
        before = {n: p.detach().clone() for n, p in model.named_parameters()
                  if n.startswith("mtp.")}
        m = run()
        engine.gather_params()
        moved = max(float((p.detach() - before[n]).abs().max())
                    for n, p in model.named_parameters() if n in before)
        return {"keys": sorted(m), "mtp_loss": m.get("mtp/loss"), "moved": moved,
                "tensors": len(before)}

    out = []
    for examples in (mixed, rejected):
        weights = mtp_weights(engine, example_batch(cfg, engine, reference, examples)[1], cfg)
        out.append({**step(lambda: kto_step(engine, reference, examples, cfg)),
                    "weights": weights.tolist(), "labels": [e.label for e in examples],
                    "counts": [float(sum(e.sample.loss_mask)) for e in examples]})
    pairs = dpo_check.pair_batches(hf["vocab_size"])[0]
    dpo = step(lambda: dpo_step(engine, reference, pairs, dpo_check.run_cfg({})))
    engine.release()
    return {"steps": out, "dpo": dpo}
