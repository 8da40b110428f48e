"""Weight gradients accumulated in fp32 straight into megatron DDP's main_grad
(models.build.wgrad_fp32: megatron's gradient_accumulation_fusion with a torch stand-in for
Apex's kernel; engine.training.loss_head: the output weight's gradient): in bf16, over several
micro-batches, megatron's Column/RowParallelLinear at TP1, TP2 and TP2+SP and the chunked loss
head at TP1/TP2 accumulate the exact sum of their GEMM products to fp32 precision, where the
unfused path (a bf16 gradient per micro-batch, per chunk in the head before) is off by bf16
rounding; in fp32 the fused and unfused main_grad are bitwise equal, in a whole model too (TP2+SP,
PP2); the tied embedding keeps its lookup gradient (negative control: without megatron's
zero_out_wgrad mark it is lost, and the test sees it)."""
import pytest

from tests.launch import result_lines

FP32_LEVEL = 1e-5   # measured: 1e-7 .. 4e-7
BF16_LEVEL = 1e-3   # measured: the rounding paths 1.9e-3 .. 3.4e-3 (2^-9 = 2.0e-3)


@pytest.fixture(scope="module")
def results(pools, tiny_model_dirs):
    """The RESULT lines of tests/multirank/fp32_wgrad_check.py on 2 ranks (the rank pool)."""
    proc = pools.script(2, "tests/multirank/fp32_wgrad_check.py", tiny_model_dirs["qwen3"],
                        timeout=600)
    assert proc.returncode == 0
    return result_lines(proc.stdout)


def test_megatron_linears_accumulate_micro_batches_in_fp32(results):
    cases = [r for r in results if r["kind"] == "linear"]
    assert {(r["tp"], r["sp"], r["linear"]) for r in cases} == {
        (tp, sp, name) for tp, sp in ((1, False), (2, False), (2, True))
        for name in ("column", "row")}
    for r in cases:
        assert r["main_grad_dtype"] == "torch.float32", r
        assert r["fused_rel"] < FP32_LEVEL, r
        assert r["unfused_rel"] > BF16_LEVEL, r        # negative control: the old path
        assert r["unfused_rel"] > 1000 * r["fused_rel"], r


def test_fp32_linears_are_bitwise_unchanged(results):
    cases = [r for r in results if r["kind"] == "linear"]
    assert cases and all(r["fp32_bitwise"] and r["fp32_nonzero"] for r in cases)


def test_loss_head_output_weight_gradient_is_not_rounded_per_chunk(results):
    cases = [r for r in results if r["kind"] == "head"]
    assert {r["tp"] for r in cases} == {1, 2}
    for r in cases:
        # the exact sum of what the GEMMs were given, and the same for any chunk size
        assert r["fused_exact_rel"] < FP32_LEVEL, r
        assert r["chunk_rel"] < FP32_LEVEL, r
        # negative controls: a bf16 gradient per chunk (the head before) or per micro-batch
        assert r["per_chunk_bf16_exact_rel"] > BF16_LEVEL, r
        assert r["per_chunk_bf16_chunk_rel"] > BF16_LEVEL, r
        assert r["no_main_grad_exact_rel"] > BF16_LEVEL, r
        # against the same head in fp32 (bf16 grad_z, a bf16 GEMM input, is common to all)
        assert r["fused_rel"] < 2.5e-3, r
        assert r["fused_rel"] < r["no_main_grad_rel"], r
        assert r["fused_rel"] < r["per_chunk_bf16_rel"], r


def test_whole_model_fp32_bitwise_and_bf16_close(results):
    cases = [r for r in results if r["kind"] == "model" and not r.get("broken")]
    assert {(r["layout"], r["dtype"]) for r in cases} == {
        (layout, dtype) for layout in ("tp2_sp", "pp2")
        for dtype in ("torch.float32", "torch.bfloat16")}
    for r in cases:
        assert r["micro_batches"] > 1 and r["linears"] > 0, r
        assert r["main_grad_dtype"] == "torch.float32", r
        if r["dtype"] == "torch.float32":
            assert r["bitwise"], r
        else:  # differs from the unfused path by the rounding that path adds
            assert not r["bitwise"] and r["rel"] < 1e-2, r


def test_tied_embedding_lookup_gradient_is_kept(results):
    (broken,) = [r for r in results if r["kind"] == "model" and r.get("broken")]
    assert broken["rel"] > 0.1, broken
    assert "word_embeddings" in broken["worst_rank0"], broken
