"""Per-token log-probs and entropy from vocab-parallel logits are exact and never see logits
modified in place (engine.training.token_losses; the correctness issue's entropy defect)."""
from tests.launch import result_lines


def test_logprobs_and_entropy_match_float64_reference_on_every_case(pools):
    proc = pools.script(2, "tests/multirank/token_losses_check.py", timeout=300)
    assert proc.returncode == 0
    results = result_lines(proc.stdout)
    assert len(results) == 16  # tp 1/2 x fp32/bf16 x T 1.0/0.8 x padded/unpadded vocab
    for r in results:
        case = {k: r[k] for k in ("tp", "dtype", "temperature", "padded")}
        assert r["logits_unchanged"], case
        assert r["logp_err"] < 1e-5, case
        assert r["entropy_err"] < 1e-5, case
        assert r["entropy_ref_mean"] > 0.5, case  # a real distribution, not a degenerate one
    # negative control: the old order (in-place cross-entropy on the caller's float32 tensor,
    # then entropy) is caught exactly where the issue found it, T = 1.0 without padding rows
    hit = [r for r in results if r["dtype"] == "torch.float32" and r["temperature"] == 1.0
           and not r["padded"]]
    assert len(hit) == 2 and all(r["defect_entropy_err"] > 0.1 for r in hit)
