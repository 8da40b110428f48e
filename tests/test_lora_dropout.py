"""model.lora.dropout acts in training only (docs/lora.md#dropout): every forward-only pass
(TrainEngine.forward_only: eval/*, the DPO reference, RL's old / reference log-probs) runs
without it, as peft's eval mode and TRL's `disable_dropout` do, so it is deterministic and the
same as with dropout 0; a train step still applies it. tests/multirank/lora_dropout_check.py on
one process of the rank pool, tiny Qwen3 from a PEFT adapter with non-zero B, dropout 0.5."""
from __future__ import annotations

import pytest

from tools.tiny_models import build_peft_adapter, build_tiny_model


@pytest.fixture(scope="module")
def dropout_run(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_dropout")
    model = build_tiny_model(str(root / "qwen3"), "qwen3", hidden=64, layers=2, heads=8,
                             kv_heads=2, vocab_size=200, seed=0, initializer_range=0.2,
                             tokenizer=False)
    adapter = build_peft_adapter(model, str(root / "adapter"), rank=4, alpha=8, std=0.2)
    return pools.run(1, "tests.multirank.lora_dropout_check:dropout_check", model, adapter,
                     timeout=300)[0]


def test_forward_only_passes_run_without_lora_dropout(dropout_run):
    """Two forward-only passes of the dropout-0.5 policy are bitwise equal and equal the
    dropout-0 policy's log-probs; the negative control (dropout left on in forward-only
    passes, the engine before) differs between two passes and from dropout 0."""
    r = dropout_run
    assert r["tokens"] > 20, r
    assert r["repeat"] == 0.0 and r["vs_no_dropout"] == 0.0, r
    assert r["control_repeat"] > 1e-2 and r["control_vs_no_dropout"] > 1e-2, r


def test_a_train_step_still_applies_lora_dropout(dropout_run):
    """The loss of the first train step (its forward before the update) with dropout 0.5
    differs from dropout 0's on the same batch and weights."""
    assert dropout_run["train_vs_no_dropout"] > 1e-3, dropout_run
