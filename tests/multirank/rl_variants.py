"""Policy-loss / estimator / rollout-correction variants of the RL invariance harness
(tests/multirank/rl_invariance.py, which runs them on its dense specs; results keyed "var/NAME").

Cheap by construction (they ride in the harness's two launches):
  * one model build per layout, shared by every variant: before each variant the parameters
    are restored from a snapshot of the loaded weights and a fresh optimizer and LR schedule
    are created (no Adam state or step count leaks from one variant into the next);
  * the token log-prob table is computed once per layout (the weights are the same before
    every variant, and the table does not depend on the advantages);
  * ONE optimizer step on the whole batch (VARIANT_STEPS): the compared loss, metrics and grad
    norm are computed at the loaded weights, the parameters after the step (weight sync) check
    the whole gradient. A second step adds nothing the loss functions can get wrong, and it is
    ill-conditioned: at lr 1e-2 the first step (grad norm up to 12) moves the policy so far that
    a step-2 loss near zero (sapo: 0.037 from token terms of order 1) carries float32 reduction-
    order noise of the first step at ~1e-5 relative. Measured in ONE process, micro-batch size 1
    vs 2 (no collective involved): sapo's step-1 loss rel 5e-7, step-2 loss rel 1.6e-5, step-2
    metrics rel 3e-5 (bypass_ppo_clip's too), grad norms and weights 2e-6 - rounding, not a
    layout dependence;
  * the CP layout runs only the variants with whole-sequence quantities in the update forward
    (CP_VARIANTS: GSPO's sequence ratio, GMPO's geometric mean, bypass mode's sequence IS
    weight), whose classic bug is a per-shard sum; everything else is per token there.
The variant engine is built without communication overlap (flag ov): overlap is covered by the
harness's own modes at the same layouts and is independent of the loss function.
"""
from __future__ import annotations

from types import SimpleNamespace

VARIANT_STEPS = 1
# name -> (policy loss, advantage estimator, aggregation mode, rollout_correction keys)
VARIANTS = {
    "gspo": ("gspo", "grpo", "seq-mean-token-mean",
             dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.05")),
    "geo_mean": ("geo_mean", "reinforce_plus_plus", "token-mean",
                 dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")),
    "cispo": ("cispo", "reinforce_plus_plus_baseline", "token-mean",
              dict(rollout_is="token", rollout_is_batch_normalize=True,
                   rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_3")),
    "sapo": ("sapo", "grpo", "seq-mean-token-mean",
             dict(rollout_is="sequence", rollout_is_batch_normalize=True)),
    "bypass_reinforce": ("ppo_clip", "grpo", "token-mean",
                         dict(bypass_mode=True, loss_type="reinforce", rollout_is="sequence",
                              rollout_rs="seq_max_k3", rollout_rs_threshold="0.1")),
    "bypass_ppo_clip": ("ppo_clip", "rloo", "seq-mean-token-mean",
                        dict(bypass_mode=True, rollout_is="token", rollout_rs="token_k2",
                             rollout_rs_threshold="0.1")),
}
CP_VARIANTS = ("gspo", "geo_mean", "bypass_reinforce")


def variants_for(layout_kw: dict) -> tuple:
    """The variants run at a layout: all of them, only CP_VARIANTS with context parallelism."""
    return CP_VARIANTS if layout_kw.get("cp", 1) > 1 else tuple(VARIANTS)


class SharedEngine:
    """One TrainEngine per layout, reset to the loaded weights with a fresh optimizer and
    schedule before each variant (`fresh()`). Collective over the world like the engine."""

    def __init__(self, model_dir, hf_config, layout_kw, world, train, sp):
        import dataclasses

        from engine.config.moe_settings import MoEConfig, moe_overrides
        from tests.multirank import rl_invariance as inv

        inv.OVERLAP["on"] = None  # overlap is the harness's modes' business (module docstring)
        overrides = moe_overrides(SimpleNamespace(moe=MoEConfig()), hf_config)
        self.state = inv._setup(model_dir, hf_config, layout_kw, world, train,
                                dict(overrides, sequence_parallel=sp), steps=VARIANT_STEPS)
        self.optim = inv.optim_settings()
        self.snapshot = [[p.detach().clone() for p in c.parameters()] for c in self.state.chunks]
        self.replace = dataclasses.replace

    def fresh(self):
        """The engine at the loaded weights, with a new optimizer and LR schedule."""
        import torch

        from engine.training.nonfinite import NonFiniteGuard
        from engine.training.optimizers import build_optimizer, build_scheduler

        with torch.no_grad():
            for chunk, saved in zip(self.state.chunks, self.snapshot):
                for p, s in zip(chunk.parameters(), saved):
                    p.copy_(s)
        optimizer = build_optimizer(self.state.chunks, self.optim, torch.float32)
        return self.replace(self.state, optimizer=optimizer, guard=NonFiniteGuard(),
                            scheduler=build_scheduler(optimizer, self.optim, VARIANT_STEPS))


def run_variant(shared: SharedEngine, table, variant, batch, temperature):
    """(results of the VARIANT_STEPS steps, the weights synced to rank 0's recording engine or
    None elsewhere) of `variant` on `batch`, starting from the loaded weights; `table`: the
    log-prob table of the loaded weights (compute_token_logprobs, shared by all variants)."""
    import torch.distributed as dist

    from engine.rl.policy.update import PolicyLossSettings, policy_update, split_mini_batches
    from engine.rl.policy.weight_sync import sync_to_rollout
    from tests.multirank import rl_invariance as inv

    state = shared.fresh()
    loss, _, mode, correction = VARIANTS[variant]
    seqs, _, corr, batch_metrics = inv._sequences(state, batch, temperature, correction,
                                                  table=table)
    settings = PolicyLossSettings(vocab_size=state.vocab_size, policy_loss=loss,
                                  bypass=corr if corr.bypass_mode else None,
                                  **dict(inv.SETTINGS, temperature=temperature))
    loss_cfg = SimpleNamespace(agg_mode=mode, count_empty_sequences=True)
    results = [{**batch_metrics, **policy_update(state, [seqs[i] for i in part], loss_cfg,
                                                 settings, inv.HORIZON)}
               for part in split_mini_batches(len(seqs), VARIANT_STEPS, seed=7, step=0,
                                              epoch=0)]
    engine = inv.RecordingEngine() if dist.get_rank() == 0 else None
    sync_to_rollout(state.chunks, state.hf_config, engine, bucket_mb=0.05)
    return results, (engine.tensors if engine else None)
