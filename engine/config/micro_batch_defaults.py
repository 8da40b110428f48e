"""Micro-batching when the user sets none of it (docs/rl.md#micro-batches-by-default): RL's
(`resolve_micro_batching`) and that of SFT, DPO, KTO and reward models
(`apply_sft_micro_batching`: the same token budget; prefix sharing stays their
train.prefix_sharing).

Two keys of the RL schema have defaults that depend on the model:

- ``train.micro_batch_size`` and ``train.max_tokens_per_micro_batch`` both null (the
  default): the updates' micro-batches are cut by a token budget,
  ``default_token_budget(hf_config, seq_length, bf16)``: the tokens whose kept activations
  (models.estimate.training_memory, one GPU of a TP1 / PP1 / CP1 layout, no recomputation)
  fit in ACTIVATION_BUDGET_GIB, at least train.seq_length (a longest sequence runs alone) and
  at most MAX_SEQUENCES x train.seq_length. It is a function of the model and the sequence
  length only, never of the layout, so every layout of a run plans the same budget (the
  promise: the loss does not depend on the micro-batching anyway; the budget only decides
  how much work one forward does). Setting either key keeps today's meaning:
  micro_batch_size sequences (prefix sharing: groups) per micro-batch, or that budget.
- ``train.prefix_sharing``: ``auto`` (the default; null reads the same) | ``true`` | ``false``.
  ``auto`` is on where sharing is exact for this run (engine.config.prefix_sharing_settings
  finds no problem with it on) and off, without a refusal, where it is not; ``true`` refuses
  what sharing cannot do exactly. Where the rows of a micro-batch share too little
  (the tree saves under engine.training.prefix_tree's threshold), that micro-batch runs its
  rows unshared, within the budget, so ``auto`` costs nothing on prompts sharing nothing
  (docs/benchmarks.md measures it).

``resolve_micro_batching`` returns the settings a run uses and the run header's line that says
what was chosen and why. It imports no torch: it runs in the fast config check too.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from engine.config.prefix_sharing_settings import prefix_sharing_problems, sharing_choice
from models.estimate.training_memory import GIB, estimate_memory
from parallel.layout import ParallelLayout

ACTIVATION_BUDGET_GIB = 8.0    # kept activations (and logits) of one micro-batch
MAX_SEQUENCES = 16             # the budget never passes this many full-length sequences
def activation_bytes_per_token(hf_config: dict, bf16: bool, seq_length: int,
                               loss_chunk_tokens: int | None) -> float:
    """Bytes that one more token of a micro-batch keeps for the backward pass (activations and
    loss-head logits; the estimate's slope between one and two full-length sequences)."""
    layout = ParallelLayout(world_size=1)

    def total(tokens: int) -> float:
        train = SimpleNamespace(max_tokens_per_micro_batch=tokens, micro_batch_size=1,
                                seq_length=seq_length, loss_chunk_tokens=loss_chunk_tokens)
        est = estimate_memory(hf_config, layout, train, bf16, False, 1, ("none", None, None))
        return (est.activations + est.logits) * GIB

    return max(1.0, (total(2 * seq_length) - total(seq_length)) / seq_length)


def default_token_budget(hf_config: dict, seq_length: int, bf16: bool,
                         loss_chunk_tokens: int | None = None) -> int:
    """The token budget per micro-batch of the module docstring."""
    return _budget(activation_bytes_per_token(hf_config, bf16, seq_length, loss_chunk_tokens),
                   seq_length)


def _budget(per_token: float, seq_length: int) -> int:
    fitting = int(ACTIVATION_BUDGET_GIB * GIB // per_token)
    return max(seq_length, min(fitting, MAX_SEQUENCES * seq_length))


@dataclass(frozen=True)
class MicroBatching:
    """What an RL run's updates use: engine.training.train_engine.BatchSettings's fields."""
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    prefix_sharing: bool
    header: str            # the run header's line: what was chosen and why


def resolve_micro_batching(cfg: Any, hf_config: dict) -> MicroBatching:
    """The micro-batching of `cfg.train` (an RL config) for this model (module docstring)."""
    train = cfg.train
    choice = sharing_choice(train.prefix_sharing)
    if choice == "auto":
        blockers = prefix_sharing_problems(cfg, hf_config, force=True)
        sharing = not blockers
        why = ("on (train.prefix_sharing=auto: exact for this model and settings; a "
               "micro-batch whose rows share too little runs them unshared)" if sharing else
               f"off (train.prefix_sharing=auto: {blockers[0]})")
    else:
        sharing = choice == "true"
        why = f"{'on' if sharing else 'off'} (train.prefix_sharing={choice})"
    if train.max_tokens_per_micro_batch:
        size, budget = train.micro_batch_size or 1, train.max_tokens_per_micro_batch
        how = f"a token budget of {budget} (train.max_tokens_per_micro_batch)"
    elif train.micro_batch_size:
        size, budget = train.micro_batch_size, None
        unit = "groups of rows sharing a prefix" if sharing else "sequences"
        how = f"{size} {unit} each (train.micro_batch_size)"
    else:
        size, (budget, how) = 1, _default_budget(cfg, hf_config)
    return MicroBatching(size, budget, sharing,
                         f"micro-batches: {how}; prefix sharing {why}")


def _default_budget(cfg: Any, hf_config: dict) -> tuple[int, str]:
    """(the default token budget of cfg's model and train.seq_length, the header's words)."""
    train = cfg.train
    per_token = activation_bytes_per_token(hf_config, cfg.model.dtype == "bfloat16",
                                           train.seq_length, train.loss_chunk_tokens or None)
    budget = _budget(per_token, train.seq_length)
    return budget, (f"a token budget of {budget} (default: the tokens whose activations, about "
                    f"{per_token / 1024:.0f} KiB each, fit in {ACTIVATION_BUDGET_GIB:g} GiB, "
                    f"from train.seq_length={train.seq_length} to {MAX_SEQUENCES} x it; set "
                    "train.micro_batch_size or train.max_tokens_per_micro_batch to choose)")


def apply_sft_micro_batching(cfg: Any, hf_config: dict) -> str:
    """SFT, DPO, KTO and reward models (SFT's train.* keys): where train.micro_batch_size and
    train.max_tokens_per_micro_batch are both null (their default), the micro-batches are cut
    by the default token budget (module docstring). Sets cfg.train's two keys to what the run
    uses (micro_batch_size 1 beside a budget) and returns the run header's line. Called once
    per run (engine.run.train_engine_build) or recipe check, before anything reads them."""
    train = cfg.train
    if train.max_tokens_per_micro_batch:
        train.micro_batch_size = train.micro_batch_size or 1
        return (f"micro-batches: a token budget of {train.max_tokens_per_micro_batch} "
                "(train.max_tokens_per_micro_batch)")
    if train.micro_batch_size:
        return f"micro-batches: {train.micro_batch_size} each (train.micro_batch_size)"
    budget, how = _default_budget(cfg, hf_config)
    train.micro_batch_size, train.max_tokens_per_micro_batch = 1, budget
    return f"micro-batches: {how}"


def resolved_train(cfg: Any, hf_config: dict) -> SimpleNamespace:
    """A copy of `cfg.train`'s keys with micro_batch_size, max_tokens_per_micro_batch and
    prefix_sharing as resolve_micro_batching resolves them (the memory estimates of
    `validate rl --recipe` plan the micro-batches a run would)."""
    micro = resolve_micro_batching(cfg, hf_config)
    keys = {k: getattr(cfg.train, k) for k in cfg.train.keys()} if hasattr(
        cfg.train, "keys") else dict(vars(cfg.train))
    keys.update(micro_batch_size=micro.micro_batch_size,
                max_tokens_per_micro_batch=micro.max_tokens_per_micro_batch,
                prefix_sharing=micro.prefix_sharing)
    return SimpleNamespace(**keys)


def per_micro_batch(train: Any, units: int | None = None) -> str:
    """How a recipe report words train's micro-batches (resolved, apply_sft_micro_batching):
    "a token budget of N per micro-batch", or "M per micro-batch" (`units`: M instead of
    train.micro_batch_size, e.g. pairs where the train view counts sequences)."""
    if train.max_tokens_per_micro_batch:
        return f"a token budget of {train.max_tokens_per_micro_batch} per micro-batch"
    return f"{units if units is not None else train.micro_batch_size} per micro-batch"
