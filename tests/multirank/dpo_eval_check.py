"""DPO evaluation in chunks (engine.dpo.training.evaluate), run on the session's rank pools by
tests/test_dpo_units.py: EVAL_PAIRS pairs of tests.multirank.dpo_check (sides of very different
lengths) evaluated with train.global_batch_size=CHUNK, so the chunks hold 3, 3 and 1 pairs with
unequal completion token counts; sigmoid with RPO (dpo.rpo_alpha=RPO), the policy and a
different frozen reference, or orpo (no reference, no RPO); loss.agg_mode=token-mean.
Returns (rank 0) the eval/* metrics.
"""
from __future__ import annotations

from types import SimpleNamespace

EVAL_PAIRS, CHUNK, RPO = 7, 3, 0.5


def eval_pairs(vocab: int) -> list:
    """The EVAL_PAIRS pairs evaluated (the first batch of dpo_check.pair_batches, cut)."""
    from tests.multirank.dpo_check import pair_batches

    return pair_batches(vocab)[0][:EVAL_PAIRS]


def evaluate_chunks(policy_dir: str, reference_dir: str, spec: str = "1,1,0,1,2",
                    loss: str = "sigmoid") -> dict | None:
    """engine.dpo.training.evaluate at the layout `spec` (dpo_check's "tp,pp,vpp,cp,mbs") with
    dpo.loss_type `loss` (sigmoid: with RPO)."""
    import torch.distributed as dist

    from engine.dpo.training import evaluate
    from tests.multirank.dpo_check import build, run_cfg

    flags = {"loss": loss, "rpo": str(RPO)} if loss == "sigmoid" else {"loss": loss}
    policy, reference, hf_config = build(
        f"{spec}," + "+".join(f"{k}={v}" for k, v in flags.items()), policy_dir, reference_dir,
        None)
    cfg = run_cfg(flags)
    cfg.train = SimpleNamespace(seq_length=cfg.train.seq_length, global_batch_size=CHUNK)
    out = evaluate(policy, reference, eval_pairs(hf_config["vocab_size"]), cfg)
    policy.release()
    if reference.engine is not None:
        reference.engine.release()
    return out if dist.get_rank() == 0 else None
