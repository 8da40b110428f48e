"""rollout.check_behaviour_logprobs: an asynchronous run's engines checked against the policy
version that generated each batch (docs/async-rl.md).

With rollout.max_staleness = s > 0, batch k is sampled by version max(0, k - s)
(engine.rl.disaggregated.schedule) and trained by version k. `rollout/logprob_diff` compares
the engine's log-probs with version k's, so it measures the lag between the two versions, not
whether the engine held the weights it should. This check keeps, on every training rank, a host
copy of each version that a later batch is sampled with (the rank's own shard: trainable
parameters and floating-point buffers, e.g. an expert bias that moves with training; frozen
parameters never change), and before each step recomputes the batch's log-probs with that
version's weights in place. `rollout/behaviour_logprob_diff[_max]` is then the engine's own
error: fp32 on CPU, a few 1e-7 for an exact engine.

Cost: s host copies of the trainable weights, and one forward pass over the batch per step.
After a resume the first s batches were sampled by versions the checkpoint does not hold: those
steps log no behaviour metric (rank 0 says so once).
"""
from __future__ import annotations

import torch

from engine.rl.collect.batch import RolloutBatch, build_sequences
from engine.rl.disaggregated.schedule import batch_version
from engine.rl.policy.logprobs import compute_token_logprobs, logprob_gap
from engine.training.train_engine import TrainEngine


def _versioned_tensors(policy: TrainEngine) -> list[torch.Tensor]:
    """The tensors of this rank's shard that differ between policy versions, in a fixed
    order: trainable parameters, then floating-point buffers."""
    params = [p for chunk in policy.chunks for p in chunk.parameters() if p.requires_grad]
    # nn.Module.buffers: megatron's DDP wrapper has a `buffers` attribute of its own
    buffers = [b for chunk in policy.chunks for b in torch.nn.Module.buffers(chunk)
               if b.is_floating_point()]
    return params + buffers


class VersionSnapshots:
    """Host copies of the policy versions that later batches are sampled with; one per training
    rank (each holds its own shard). `keep` and `metrics` are collective over the training
    world (parameter gathers, the recompute forward)."""

    def __init__(self, max_staleness: int, max_steps: int, start: int) -> None:
        self.s, self.max_steps, self.start = max_staleness, max_steps, start
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.told_missing = False

    def _sampled_by(self, version: int, first_batch: int) -> bool:
        """Whether a batch k >= first_batch (still to be trained) is sampled by `version`."""
        return any(batch_version(k, self.s) == version
                   for k in range(first_batch, self.max_steps))

    def keep(self, policy: TrainEngine, version: int) -> None:
        """After version `version` is final (version `start` at the beginning, version v after
        step v): copy it to host memory when a later batch is sampled by it and trained by a
        newer version; drop the copies no batch needs any more."""
        self.versions = {v: t for v, t in self.versions.items()
                         if self._sampled_by(v, version)}
        if not self._sampled_by(version, version + 1):  # batch `version` trains on it itself
            return
        policy.gather_params()  # overlap_param_gather: the last step's values everywhere
        self.versions[version] = [t.detach().to("cpu", copy=True)
                                  for t in _versioned_tensors(policy)]

    def metrics(self, policy: TrainEngine, batch: RolloutBatch, step: int,
                temperature: float) -> dict[str, float]:
        """Before training batch `step` (the trainer holds version `step`): the batch's
        log-probs under the version that sampled it, against the engine's. Empty when that
        version was not kept (the first s steps after a resume)."""
        version = batch_version(step, self.s)
        seqs = build_sequences(batch)
        if version == step:  # sampled by the current weights
            table = compute_token_logprobs(policy, seqs, temperature)
        elif version not in self.versions:
            if version >= self.start:
                raise RuntimeError(f"policy version {version} of batch {step} was not kept "
                                   "(engine.rl.disaggregated.behaviour_check)")
            if not self.told_missing and torch.distributed.get_rank() == 0:
                print(f"[rl] rollout.check_behaviour_logprobs: batches {self.start} to "
                      f"{self.start + self.s - 1} were sampled by versions before the resumed "
                      "checkpoint; they log no rollout/behaviour_logprob_diff", flush=True)
            self.told_missing = True
            return {}
        else:
            table = self._under_version(policy, version, seqs, temperature)
        gap_mean, gap_max = logprob_gap(seqs, table)
        return {"rollout/behaviour_logprob_diff": gap_mean,
                "rollout/behaviour_logprob_diff_max": gap_max}

    def _under_version(self, policy: TrainEngine, version: int, seqs, temperature: float):
        """compute_token_logprobs with version `version`'s tensors in place, then the current
        ones back (copied in place: megatron's parameters are views of its buffers; the current
        values wait in host memory)."""
        policy.gather_params()  # nothing deferred may overwrite the swapped-in values
        live = _versioned_tensors(policy)
        current = [t.detach().to("cpu", copy=True) for t in live]  # host: no device copy
        try:
            with torch.no_grad():
                for t, kept in zip(live, self.versions[version]):
                    t.copy_(kept)
            return compute_token_logprobs(policy, seqs, temperature)
        finally:
            with torch.no_grad():
                for t, now in zip(live, current):
                    t.copy_(now)
