"""LoRA dropout in forward-only passes (run on the rank pool by tests/test_lora_dropout.py).

`dropout_check(model_dir, adapter)` on one process: two LoRA policies of the tiny model from the
same PEFT adapter (non-zero B, so the adapters matter), one with model.lora.dropout 0.5 and one
with 0; on a fixed batch it returns the largest differences (max |a - b| over the trained
tokens) of
- `repeat`: two forward-only passes of the dropout policy (TrainEngine.forward_only through
  engine.rl.policy.logprobs.compute_token_logprobs: the path of eval/*, the DPO reference and
  RL's old / reference log-probs);
- `vs_no_dropout`: a forward-only pass of the dropout policy against the dropout-0 policy's;
- `control_repeat`, `control_vs_no_dropout`: the same with forward_only's dropout switch made a
  no-op (the engine before issue 67: dropout in every forward pass of the training-mode model);
- `train_vs_no_dropout`: |loss| difference of one train_batch step on the batch (the loss of
  the forward before the update): dropout still acts in training.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

RANK, ALPHA, DROPOUT = 4, 8.0, 0.5


def _build(model_dir: str, hf_config: dict, adapter: str, dropout: float):
    import torch

    from engine.training.train_engine import TrainEngine
    from models.lora.adapters import LoraSpec
    from models.lora.sites import resolve_targets

    spec = LoraSpec(RANK, ALPHA, resolve_targets("all-linear"), dropout=dropout)
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    return TrainEngine.build(hf_config, optim, torch.float32, 1, train, weights_dir=model_dir,
                             lora=spec, lora_init=adapter)


@contextmanager
def _dropout_in_forward_only():
    """forward_only as before issue 67: its dropout switch does nothing."""
    import engine.training.train_engine as te

    @contextmanager
    def nothing(chunks):
        yield 0

    original, te.dropout_disabled = te.dropout_disabled, nothing
    try:
        yield
    finally:
        te.dropout_disabled = original


def dropout_check(model_dir: str, adapter: str) -> dict:
    import torch

    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from tests.multirank.loss_head_check import sequences

    setup_model_parallel(ParallelLayout(1))
    hf_config = read_config(model_dir)
    seqs = sequences(hf_config["vocab_size"])   # the loss-head check's random batch
    width = max(len(s.tokens) for s in seqs)
    keep = torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for s in seqs],
                        dtype=torch.bool)
    dropped, plain = (_build(model_dir, hf_config, adapter, p) for p in (DROPOUT, 0.0))
    assert dropped.chunks[0].training   # the policy stays in training mode between steps

    def logprobs(engine):
        return compute_token_logprobs(engine, seqs, 1.0)[keep]

    gap = lambda a, b: float((a - b).abs().max())
    torch.manual_seed(11)
    first, second, none = logprobs(dropped), logprobs(dropped), logprobs(plain)
    with _dropout_in_forward_only():
        c1, c2 = logprobs(dropped), logprobs(dropped)
    losses = []
    for engine in (dropped, plain):
        torch.manual_seed(11)
        losses.append(train_step(engine, seqs, GlobalLossNormalizer("token-mean"))["loss"])
    for engine in (dropped, plain):
        engine.release()
    return {"repeat": gap(first, second), "vs_no_dropout": gap(first, none),
            "control_repeat": gap(c1, c2), "control_vs_no_dropout": gap(c1, none),
            "train_vs_no_dropout": abs(losses[0] - losses[1]), "losses": losses,
            "tokens": int(keep.sum())}
