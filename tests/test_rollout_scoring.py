"""RolloutEngine.score (engine.generation.scoring): the HF engine's batched, right-padded scores
against transformers on each sequence alone (fp32, 1e-5; negative control: left padding without
a mask leaks), top-k ids and values against torch.topk, chunking that does not change a number,
input checks by name, the sleeping engine refused, a backend without scoring refused by name;
vLLM's prompt log-prob rows read back (the prompt's token dropped when it is not among the
top-k) and a top_k over max_logprobs refused. vLLM's engine against transformers: tests/test_vllm.py
(test_score_is_transformers_raw_log_softmax)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.generation.base import RolloutEngine
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.scoring import hf_scores
from engine.generation.vllm.scoring import prompt_scores, scoring_problem
from tools.tiny_models import build_tiny_model

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 32))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(str(tmp_path_factory.mktemp("scoring") / "qwen3"), "qwen3",
                            vocab_size=200, hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, seed=0)
    return HFRolloutEngine(path, device="cpu", dtype=torch.float32)


def reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits of `ids` alone: [len(ids) - 1, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def test_hf_scores_are_each_sequence_alone_and_padding_does_not_leak(engine):
    scores = engine.score(SEQUENCES, top_k=5)
    worst = 0.0
    for seq, got in zip(SEQUENCES, scores, strict=True):
        ref = reference(engine.model, seq)
        chosen = ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        assert len(got.logprobs) == len(got.top) == len(seq) - 1
        worst = max(worst, float((torch.tensor(got.logprobs) - chosen).abs().max()))
        values, ids = ref.topk(5, -1)
        for row, top in enumerate(got.top):
            assert list(top) == ids[row].tolist()   # the ids, most likely first
            assert torch.allclose(torch.tensor(list(top.values())), values[row], atol=1e-5)
    assert worst < 1e-5, worst
    # top_k=0: the same log-probs, no top dicts; one chunk per sequence: the same numbers
    plain = engine.score(SEQUENCES, top_k=0)
    assert [s.logprobs for s in plain] == [s.logprobs for s in scores]
    assert all(top == {} for s in plain for top in s.top)
    alone = hf_scores(engine.model, SEQUENCES, 5, engine.device, max_elements=1)
    for a, b in zip(alone, scores, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    # negative control: the short sequence left-padded without a mask sees the padding
    short, longest = SEQUENCES[1], max(map(len, SEQUENCES))
    with torch.no_grad():
        leaked = engine.model(torch.tensor([[0] * (longest - len(short)) + short])).logits
    leaked = torch.log_softmax(leaked[0, -len(short):-1].float(), -1)
    chosen = leaked.gather(1, torch.tensor(short[1:])[:, None])[:, 0]
    assert float((chosen - torch.tensor(scores[1].logprobs)).abs().max()) > 1e-3


def test_score_checks_its_input_by_name(engine):
    assert engine.score([], top_k=3) == []
    assert engine.score([[7]], top_k=3)[0].logprobs == []   # one token: nothing to score
    for bad, match in [([[5, 6], []], "sequence 1 is empty"),
                       ([[5, 200]], r"sequence 0 has token ids outside \[0, 200\): \[200\]"),
                       ([[5, -1]], r"outside \[0, 200\): \[-1\]"),
                       ([[5, 6.0]], "sequence 0 has non-integer token ids")]:
        with pytest.raises(ValueError, match=match):
            engine.score(bad, top_k=1)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0, got -1"):
        engine.score([[5, 6]], top_k=-1)
    with pytest.raises(ValueError, match="top_k=201 is more than the vocabulary"):
        engine.score([[5, 6]], top_k=201)


def test_a_sleeping_engine_and_a_backend_without_scoring_are_refused(tmp_path):
    path = build_tiny_model(str(tmp_path / "qwen3"), "qwen3", vocab_size=200, hidden=32,
                            layers=1, heads=2, kv_heads=1, intermediate=64, seed=0)
    engine = HFRolloutEngine(path, device="cpu", dtype=torch.float32)
    engine.sleep()
    with pytest.raises(RuntimeError, match="score: the rollout engine is asleep"):
        engine.score([[5, 6]], top_k=1)
    engine.wake()
    with pytest.raises(RuntimeError, match="score: .* have not been written since wake"):
        engine.score([[5, 6]], top_k=1)

    class NoScores(RolloutEngine):
        _generate = update_weights = sleep = wake = lambda *a: None

    assert not NoScores.supports_scoring and HFRolloutEngine.supports_scoring
    with pytest.raises(NotImplementedError, match="test_rollout_scoring.NoScores cannot score"):
        NoScores().score([[5, 6]], top_k=1)


def _row(token_logprobs: dict[int, tuple[float, int]]) -> dict:
    return {t: SimpleNamespace(logprob=lp, rank=r) for t, (lp, r) in token_logprobs.items()}


def test_vllm_prompt_logprob_rows_read_back_as_scores():
    # the prompt's token first (vLLM's order), then the top-2 by rank
    rows = [None, _row({4: (-3.0, 7), 9: (-0.5, 1), 2: (-1.0, 2)}),   # 4 not among the top 2
            _row({2: (-1.2, 2), 8: (-0.4, 1)})]                      # 2 is the second
    got = prompt_scores([1, 4, 2], rows, top_k=2)
    assert got.logprobs == [-3.0, -1.2]
    assert [list(t.items()) for t in got.top] == [[(9, -0.5), (2, -1.0)], [(8, -0.4), (2, -1.2)]]
    zero = prompt_scores([1, 4], [None, _row({4: (-3.0, 7)})], top_k=0)
    assert zero.logprobs == [-3.0] and zero.top == [{}]
    with pytest.raises(RuntimeError, match="2 prompt log-prob rows for a sequence of 3"):
        prompt_scores([1, 4, 2], rows[:2], top_k=2)
    assert "top_k=21 is over this vLLM engine's max_logprobs=20" in scoring_problem(
        [[1, 2]], 21, 20, 64)
    assert scoring_problem([[1, 2]], 20, 20, 64) is None
    assert scoring_problem([[1, 2]], 500, -1, 64) is None   # -1: no cap
    assert "sequence 1 has 64 tokens" in scoring_problem([[1], [1] * 64], 0, 20, 64)
