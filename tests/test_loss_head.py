"""The chunked vocab-parallel loss head (engine.training.loss_head, models.layers.heads.output) gives
today's unchunked numbers: log-probs, entropy, the hidden-state and output-weight gradients, at
TP1/TP2, with Megatron SP, tied and untied embeddings, PP2, CP2 with packing, forward-only
log-probs; a backward without the TP sum of the hidden-state gradient is caught. And the
train.loss_chunk_tokens key is validated before any process group exists."""
import pytest

from tests.launch import result_lines

TOL = 1e-5


@pytest.fixture(scope="module")
def results(pools, tiny_model_dirs):
    """The RESULT lines of tests/multirank/loss_head_check.py on 2 ranks (the rank pool)."""
    proc = pools.script(2, "tests/multirank/loss_head_check.py", tiny_model_dirs["qwen3"],
                        tiny_model_dirs["qwen2"], timeout=900)
    assert proc.returncode == 0
    return result_lines(proc.stdout)


def test_chunked_function_matches_unchunked(results):
    cases = [r for r in results if r["kind"] == "function" and not r.get("broken")]
    # tp1: 8 fp32 + 1 bf16; tp2 without and with SP: 9 each
    assert len(cases) == 27
    assert {(r["tp"], r["sp"]) for r in cases} == {(1, False), (2, False), (2, True)}
    for r in cases:
        tol = TOL if r["dtype"] == "torch.float32" else 2e-2  # bf16 logits/grad casts
        for key in ("logp_rel", "hidden_grad_rel", "weight_grad_rel"):
            assert r[key] < tol, (key, r)
        if r["entropy"]:
            assert r["entropy_rel"] < tol, r


def test_dropped_tp_reduction_of_hidden_grad_is_caught_in_the_function(results):
    broken = [r for r in results if r["kind"] == "function" and r.get("broken")]
    assert len(broken) == 2  # TP2 without and with SP
    for r in broken:
        assert r["hidden_grad_rel"] > 0.1, r
        assert r["logp_rel"] < TOL and r["weight_grad_rel"] < TOL, r  # forward and dW are fine


def test_chunked_head_matches_unchunked_in_the_model(results):
    cases = [r for r in results if r["kind"] == "model" and not r.get("broken")]
    assert {(r["model"], r["layout"]) for r in cases} == {
        (m, layout) for m in ("tied", "untied")
        for layout in ("dp2", "tp2", "tp2_sp", "pp2", "cp2_packed")}
    for r in cases:
        assert r["loss"] > 1.0, r  # a real loss (log 200 ~ 5.3 at init)
        assert r["loss_rel"] < TOL, r
        assert r["grad_rel"] < TOL, r
        assert r["logprob_rel"] < TOL, r


def test_dropped_tp_reduction_of_hidden_grad_is_caught_in_the_model(results):
    broken = [r for r in results if r["kind"] == "model" and r.get("broken")]
    assert {(r["model"], r["layout"]) for r in broken} == {
        (m, layout) for m in ("tied", "untied") for layout in ("tp2", "tp2_sp")}
    for r in broken:
        assert r["loss_rel"] < TOL, r       # the forward is unaffected
        assert r["grad_rel"] > 1e-2, r      # the layers behind the head get wrong gradients


def test_loss_chunk_tokens_is_validated():
    from types import SimpleNamespace

    from engine.config.model_settings import loss_chunk_problems
    from engine.config.schema import TrainConfig
    from engine.rl.config import RLTrainConfig
    from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS

    assert TrainConfig().loss_chunk_tokens == RLTrainConfig().loss_chunk_tokens
    assert TrainConfig().loss_chunk_tokens == DEFAULT_LOSS_CHUNK_TOKENS > 0  # chunked default
    for ok in (None, 0, 1, 4096):
        assert loss_chunk_problems(SimpleNamespace(loss_chunk_tokens=ok)) == []
    for bad in (-1, 2.5, True):
        (problem,) = loss_chunk_problems(SimpleNamespace(loss_chunk_tokens=bad))
        assert problem.startswith(f"train.loss_chunk_tokens={bad!r} must be null or an integer")
