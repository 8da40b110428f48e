"""Log-probs and entropy from vocab-parallel logits against a float64 full-vocabulary
reference (launched by tests/test_token_losses.py).

    torchrun --nproc_per_node 2 tests/multirank/token_losses_check.py

For TP 1 and 2, float32 and bfloat16 logits, temperature 1.0 and 0.8, and a vocabulary with
and without padding rows in a TP rank's slice: token_logprobs runs first and token_entropy
second on the SAME logits tensor (the order of the RL policy loss), then both are compared with
log_softmax / entropy of the float64 logits over the real vocabulary. Negative control: the
same sequence with megatron's in-place vocab_parallel_cross_entropy given the caller's tensor
(the old defect) must be detected. Rank 0 prints one "RESULT {json}" line per case.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402

from engine.training.token_losses import token_entropy, token_logprobs  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown  # noqa

PADDED_VOCAB = 128


def reference(full: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float):
    """(log p(label), entropy) in float64 over the first `vocab` rows of `full` [b, s, V]."""
    z = full[..., :vocab].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def old_defect(local: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float):
    """The pre-fix order: cross-entropy mutates the caller's float32 logits, entropy reads them."""
    logits = local.float()  # no copy for float32 (nor a temperature division at T = 1)
    if temperature != 1.0:
        logits = logits / temperature
    logp = -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
    return logp, token_entropy(logits, vocab, 1.0)


def run_case(tp_rank: int, tp: int, dtype: torch.dtype, temperature: float, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(2, 5, PADDED_VOCAB, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    width = PADDED_VOCAB // tp
    local = full[..., tp_rank * width:(tp_rank + 1) * width].clone()
    before = local.clone()
    logp = token_logprobs(local, labels, vocab, temperature)
    entropy = token_entropy(local, vocab, temperature)
    ref_logp, ref_entropy = reference(full, labels, vocab, temperature)
    out = {"logp_err": float((logp.double() - ref_logp).abs().max()),
           "entropy_err": float((entropy.double() - ref_entropy).abs().max()),
           "entropy_ref_mean": float(ref_entropy.mean()),
           "logits_unchanged": bool(torch.equal(local, before))}
    if dtype == torch.float32:
        bad_logp, bad_entropy = old_defect(local.clone(), labels, vocab, temperature)
        out["defect_entropy_err"] = float((bad_entropy.double() - ref_entropy).abs().max())
    return out


def main() -> None:
    _, world = init_distributed()
    for tp in (1, 2):
        setup_model_parallel(ParallelLayout(world, tp=tp))
        for dtype in (torch.float32, torch.bfloat16):
            for temperature in (1.0, 0.8):
                for vocab in (PADDED_VOCAB, 100):  # 100: the last TP slice holds padding rows
                    out = run_case(ps.get_tensor_model_parallel_rank(), tp, dtype, temperature,
                                   vocab)
                    if dist.get_rank() == 0:
                        out.update(tp=tp, dtype=str(dtype), temperature=temperature,
                                   padded=vocab != PADDED_VOCAB)
                        print("RESULT " + json.dumps(out), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
