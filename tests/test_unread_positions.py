"""train.skip_unread_positions (models.layers.unread_positions): the last layer's MLP runs only at
the positions a loss reads, and every number a loss, its gradient or a log-prob table reports is
the full layer's, at DP2, TP2, PP2, CP2 packed, DP2 packed and a prefix tree at DP2; under
Megatron SP (named) and for a tree at CP2 the full layer runs. Negative control: at an unread position the two modes' log-probs differ, so a
consumer reading one would be caught; the MLP saw fewer rows (the skip happened)."""
import pytest
import torch

from tests.launch import result_lines

TOL = 1e-6


@pytest.fixture(scope="module")
def results(pools, tiny_model_dirs):
    """The RESULT lines of tests/multirank/unread_positions_check.py on 2 ranks (the rank pool)."""
    proc = pools.script(2, "tests/multirank/unread_positions_check.py",
                        tiny_model_dirs["qwen3"], timeout=900)
    assert proc.returncode == 0
    return {r["layout"]: r for r in result_lines(proc.stdout)}


def test_skipping_gives_the_full_layers_numbers(results):
    assert set(results) == {"dp2", "tp2", "tp2_sp", "pp2", "cp2_packed", "dp2_packed",
                            "dp2_tree", "cp2_tree"}
    for name, r in results.items():
        assert r["loss"] > 1.0, r                      # a real loss (log 200 ~ 5.3 at init)
        assert r["loss_rel"] < TOL and r["entropy_rel"] < TOL, (name, r)
        assert r["grad_rel"] < 1e-5, (name, r)
        assert r["table_rel"] < TOL and r["table_zero_unread"], (name, r)


def test_the_skip_happens_and_unread_positions_are_not_the_models(results):
    for name, r in results.items():
        if name in ("tp2_sp", "cp2_tree"):   # the full layer: SP; a tree's row at CP > 1
            assert r["unsupported"] == ("Megatron sequence parallelism" if name == "tp2_sp"
                                        else None)
            assert r["rows_skip"] == r["rows_full"] and r["unread_gap"] == 0.0, r
            continue
        assert r["unsupported"] is None, r
        # a tree runs each prompt once, so its replies are a larger share of its rows
        assert r["rows_skip"] < (0.6 if name == "dp2_tree" else 0.4) * r["rows_full"], (name, r)
        assert r["unread_gap"] > 0.1, (name, r)        # >= 1e5 x the tolerance above


def test_kept_rows_index_the_layers_sequence_major_input():
    from models.layers.unread_positions import kept_rows

    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])         # [b=2, s=3]
    # the layer's input is [s, b, h]: flat index t * b + row
    assert kept_rows(mask).tolist() == [0 * 2 + 1, 1 * 2 + 0, 2 * 2 + 0]
