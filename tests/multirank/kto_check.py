"""KTO's part of the DPO layout harness (tests/multirank/dpo_check.py runs a spec with flag
`kto` here; tests/test_dpo.py asserts). Spec flags beside the layout ones: kto, uw=W
(kto.undesirable_weight), dw=W (kto.desirable_weight), bug=mbkl (the negative control: each
micro-batch's examples use the mean of their OWN mismatched-pair terms as the KL reference
point, clamped at 0, instead of the global batch's)."""
from __future__ import annotations

import random
from types import SimpleNamespace

STEPS, EXAMPLES, SEQ_LENGTH, BETA = 2, 8, 64, 0.1
METRICS = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy")


def example_batches(vocab: int, seed: int = 0) -> list[list]:
    """STEPS batches of EXAMPLES unpaired examples: a prompt of 3..14 tokens, a completion of
    2..24 tokens (the last example's 30), every completion token trained; labels 5 true and
    3 false in a random order per batch."""
    from engine.data.datasets import Sample
    from engine.data.preference_unpaired_dataset import UnpairedExample

    rng = random.Random(seed)
    out = []
    for _ in range(STEPS):
        labels = [True] * 5 + [False] * (EXAMPLES - 5)
        rng.shuffle(labels)
        batch = []
        for k in range(EXAMPLES):
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 14))]
            length = 30 if k == EXAMPLES - 1 else rng.randint(2, 24)
            ids = prompt + [rng.randrange(4, vocab) for _ in range(length)]
            mask = [0] * (len(prompt) - 1) + [1] * length
            batch.append(UnpairedExample(Sample(ids[:-1], ids[1:], mask), len(prompt),
                                         labels[k]))
        out.append(batch)
    return out


def run_cfg(flags: dict):
    """The keys engine.kto.training.kto_step reads."""
    return SimpleNamespace(
        kto=SimpleNamespace(beta=BETA, desirable_weight=float(flags.get("dw", 1.0)),
                            undesirable_weight=float(flags.get("uw", 1.0))),
        train=SimpleNamespace(seq_length=SEQ_LENGTH))


def inject_bug(bug: str | None):
    """mbkl: the reference point of a micro-batch's examples is clamp(mean of their own
    kl_terms, 0). Returns an undo function."""
    import engine.kto.loss_fn as loss_fn

    if bug is None:
        return lambda: None
    assert bug == "mbkl", bug
    original = loss_fn.reference_point

    def micro_batch_mean(batch, present):
        return batch.kl_terms.to(present.device)[present].mean().clamp(min=0)

    loss_fn.reference_point = micro_batch_mean
    return lambda: setattr(loss_fn, "reference_point", original)


def run_steps(policy, reference, flags: dict, vocab: int) -> dict:
    """STEPS kto_steps of the policy engine; {metric: [per step]}."""
    from engine.kto.training import kto_step

    cfg = run_cfg(flags)
    out = {k: [] for k in METRICS}
    undo = inject_bug(flags.get("bug"))
    try:
        for examples in example_batches(vocab):
            m = kto_step(policy, reference, examples, cfg)
            for k in out:
                out[k].append(m[k])
    finally:
        undo()
    return out
