"""Bridge logit parity with transformers at TP1xPP1, TP2xPP1, TP1xPP2, TP2xPP2 (also with
Megatron sequence parallelism) and PP4 for
Qwen3 (tied), Llama and Qwen2 (QKV bias, vocab 1001), loading from HF and from a TP1 Megatron
checkpoint; one 4-rank run of tests/multirank/bridge_layouts.py (on the session's rank pool,
tests/pool.py) covers all of it.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.conftest import ARCHS

# Listed here independently of the script, so a layout it silently skips fails the test.
# tp2pp2sp: Megatron sequence parallelism on an odd sequence length (padded to tp)
EXPECTED_LAYOUTS = ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp1pp4", "tp2pp2sp")
CROSS = "tp2pp1_vs_tp1pp2"
PARITY_TOL = 1e-4         # fp32 megatron vs fp32 transformers (measured <= 1e-5)
IDENTITY_TOL = 1e-6       # same weights, same layout or float64 resharding


@pytest.fixture(scope="module")
def reports(pools, tiny_model_dirs, mcore_ckpt_dirs) -> dict[tuple[str, str, str], dict]:
    """{(arch, layout, source): JSON record} printed by rank 0 of the launch."""
    args: list[str] = []
    for arch in ARCHS:
        args += ["--model", arch, tiny_model_dirs[arch], mcore_ckpt_dirs[arch]]
    proc = pools.script(4, "tests/multirank/bridge_layouts.py", *args, timeout=600)
    assert proc.returncode == 0, "bridge_layouts run failed (output printed above)"
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and "max_abs_diff" in line:
            rec = json.loads(line)
            key = (rec["arch"], rec["layout"], rec["source"])
            assert key not in out, f"duplicate report {key}"
            out[key] = rec
    return out


def test_every_combination_reported(reports):
    expected = {(a, lay, src) for a in ARCHS for lay in EXPECTED_LAYOUTS for src in ("hf", "ckpt")}
    expected |= {(a, CROSS, "ckpt_fp64") for a in ARCHS}
    assert set(reports) == expected


@pytest.mark.parametrize("source", ["hf", "ckpt"])
@pytest.mark.parametrize("layout", EXPECTED_LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(reports, arch, layout, source):
    rec = reports[(arch, layout, source)]
    # logits of a meaningful size: a parity bound of 1e-4 on std-0.01 logits would prove little
    assert rec["ref_std"] > 0.5
    diff = rec["max_abs_diff"]
    assert math.isfinite(diff) and diff <= PARITY_TOL, rec


@pytest.mark.parametrize("layout", EXPECTED_LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_load_equals_hf_load(reports, arch, layout):
    """The TP1 checkpoint resharded to `layout` holds exactly the HF weights."""
    diff = reports[(arch, layout, "ckpt")]["vs_hf_load"]
    assert math.isfinite(diff) and diff <= IDENTITY_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_at_tp2_equals_pp2(reports, arch):
    diff = reports[(arch, CROSS, "ckpt_fp64")]["max_abs_diff"]
    assert math.isfinite(diff) and diff <= IDENTITY_TOL
