"""The Tinker service's Megatron backend (engine.tinker.mcore, models.lora.tenants) equals its
transformers backend, the independent reference of tests/test_tinker.py (itself held to peft):
the same script of service operations (tests/multirank/tinker_check.py: two LoRA models batched
together, cross_entropy / importance_sampling / ppo rows, three clipped AdamW steps, their
exported states with AdamW's moments, greedy samples) on one process, at TP2 with and without
sequence parallelism, DP2, CP2, PP2 and four-rank mixes of them, held to rel 1e-5, with
negative controls (the adapters' TP reduction off; the DP or CP gradient sum dropped; the
grad norm's sum over pipeline stages dropped); a model batched with another equals it trained
alone (rel 1e-6, a third untouched). And one real launch: `megatron-sft-engine tinker
--nproc-per-node 2 parallel.tp=2` driven by the official SDK, its state resumed with the
optimizer by a transformers-backend server (a layout- and backend-independent state), every
rank's exit code checked (torchrun's)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from engine.tinker.adapters import Adapters  # noqa: E402
from engine.tinker.lora import MultiLora  # noqa: E402
from engine.tinker.ranks import OneProcess  # noqa: E402
from engine.tinker.sampler import EngineSampler  # noqa: E402
from tests.launch import free_port  # noqa: E402
from tests.multirank import tinker_check  # noqa: E402
from tests.test_tinker import _serve  # noqa: E402
from tools.tiny_models import build_eos_model  # noqa: E402

CHECK = "tests.multirank.tinker_check:megatron"
FEW = "tests.multirank.tinker_check:megatron_few_rows"
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_eos_model(str(tmp_path_factory.mktemp("tinker_megatron") / "llama"))


def _hf_adapters(model: str) -> Adapters:
    """The transformers backend's Adapters on `model` (a fresh copy of the weights)."""
    lora = MultiLora.from_folder(model)
    return Adapters(lora, OneProcess(), EngineSampler(lora, model, str))


@pytest.fixture(scope="module")
def reference(model):
    return tinker_check.exercise(_hf_adapters(model))


def _gap(a, b) -> float:
    """The largest |a - b| over the records' numbers, relative to the largest |b| of each
    compared quantity; infinite where sampled tokens differ."""
    if isinstance(b, dict):
        assert sorted(a) == sorted(b)
        return max(_gap(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)) and b and isinstance(b[0], int):
        return 0.0 if list(a) == list(b) else float("inf")
    if isinstance(b, (list, tuple)) and b and not isinstance(b[0], (int, float)):
        return max(_gap(x, y) for x, y in zip(a, b, strict=True))
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape
    finite = np.isfinite(y)
    if not finite.any():
        return 0.0
    assert (np.isfinite(x) == finite).all()
    return float(np.abs(x - y)[finite].max() / max(np.abs(y[finite]).max(), 1e-12))


RUN = ("losses", "logprobs", "grad_norms", "samples")   # per step, and the trained sampler


@pytest.fixture(scope="module")
def envelope(model, reference):
    """The states' rounding envelope of one process: the hf backend on the same rows in
    another order, and with its gradients accumulated over four pieces of each batch (as the
    pipeline stages' micro-batches accumulate them), against `reference` (the larger of the
    two, relative to each quantity's largest value)."""
    reordered = tinker_check.exercise(_hf_adapters(model), reverse=True)
    pieces = _hf_adapters(model)
    pieces.lora.micro_batches = lambda rows: [(rows * i // 4, rows * (i + 1) // 4)
                                              for i in range(4)] if rows >= 4 else [(0, rows)]
    accumulated = tinker_check.exercise(pieces)
    gap = max(_gap(reordered["states"], reference["states"]),
              _gap(accumulated["states"], reference["states"]))
    assert 0 < gap < 1e-3, gap
    return gap


def test_megatron_layouts_equal_the_transformers_backend(pools, model, reference, envelope):
    """Every step's losses, per-token log-probs and gradient norms, and the trained models'
    greedy samples (tokens, log-probs, prompt log-probs) at rel 1e-5. The exported states
    (adapters, AdamW's moments) after 3 steps are held to 4x the envelope of one process: the
    same backend on the same rows in another order or accumulated in pieces (AdamW's update
    m / sqrt(v) amplifies a gradient's rounding where successive gradients nearly cancel;
    measured 5.2e-5 and 9.0e-5 of a matrix's largest value, the layouts 4e-5 to 2.4e-4)."""
    runs = {"one process": pools.run(1, CHECK, model, 1, False)[0],
            "tp2 + sp": pools.run(2, CHECK, model, 2, True)[0],
            "tp2": pools.run(2, CHECK, model, 2, False)[0],
            "dp2": pools.run(2, CHECK, model, 1, False)[0],
            "cp2": pools.run(2, CHECK, model, 1, False, None, 2)[0],
            "tp2 + sp x cp2": pools.run(4, CHECK, model, 2, True, None, 2)[0],
            "pp2": pools.run(2, CHECK, model, 1, False, None, 1, 2)[0],
            "tp2 + sp x pp2": pools.run(4, CHECK, model, 2, True, None, 1, 2)[0],
            "pp2 x cp2": pools.run(4, CHECK, model, 1, False, None, 2, 2)[0],
            "pp2 x dp2": pools.run(4, CHECK, model, 1, False, None, 1, 2)[0]}
    gaps = {name: {k: _gap(r[k], reference[k]) for k in RUN + ("states",)}
            for name, r in runs.items()}
    assert all(g[k] < TOL for g in gaps.values() for k in RUN), gaps
    assert all(g["states"] < 4 * envelope for g in gaps.values()), (envelope, gaps)
    # the records hold what they should: 3 steps of 4 items, both adapters' moments
    assert len(reference["losses"]) == 3 and len(reference["losses"][0]) == 4
    assert reference["states"]["a"]["step"] == 3
    assert "lm_head.A" in reference["states"]["a"]["adapter"]
    assert "lm_head.A" not in reference["states"]["b"]["adapter"]
    # a failing row in a pipelined call (tinker_check.few_rows), PP2 against one rank: the
    # first AdamW step from a single row moves either run far from the hf backend's (m /
    # sqrt(v) = +-1 where a gradient is rounding; 8.9e-2 of the states at one rank too)
    few = pools.run(1, FEW, model, 1, False)[0]
    got = pools.run(2, FEW, model, 1, False, pp=2)[0]
    assert few["raised"] and got["raised"]
    assert max(_gap(got[k], few[k]) for k in ("losses", "logprobs", "grad_norms")) < TOL
    assert _gap(got["states"], few["states"]) < 4 * envelope, _gap(got["states"], few["states"])
    # negative controls: the adapters' TP reduction off, the DP, CP or PP-norm sum dropped
    controls = {"tp reduction off": pools.run(2, CHECK, model, 2, True, "tp")[0],
                "dp sum off": pools.run(2, CHECK, model, 1, False, "dp")[0],
                "cp sum off": pools.run(2, CHECK, model, 1, False, "cp", 2)[0],
                "pp norm sum off": pools.run(2, CHECK, model, 1, False, "pp", 1, 2)[0]}
    for name, r in controls.items():
        run = max(_gap(r[k], reference[k]) for k in ("logprobs", "grad_norms"))
        states = _gap(r["states"], reference["states"])
        assert run > 1e3 * TOL and states > 40 * envelope, (name, run, states, envelope)


def test_megatron_isolation_batched_equals_alone(pools, model, envelope):
    """Model a trained 2 steps alone and 2 steps with model b's rows in every batch, on the
    Megatron backend: losses and log-probs rel 1e-6, the state within 4x the envelope, a
    third model's adapter bitwise untouched. Bitwise equality does not hold at one rank or
    TP2: torch's CPU scaled_dot_product_attention (the causal flash kernel behind
    models.layers.attention.core.SDPACoreAttention) is not batch-invariant, the same rows'
    attention output moving by ~1e-7 between a batch of 3 and of 6 with bitwise-equal inputs
    (docs/tinker.md); at DP2 the runs came out bitwise equal."""
    check = "tests.multirank.tinker_check:isolation"
    results = {"one rank": pools.run(1, check, model, 1, False)[0],
               "tp2 + sp": pools.run(2, check, model, 2, True)[0],
               "dp2": pools.run(2, check, model, 1, False)[0],
               "cp2": pools.run(2, check, model, 1, False, 2)[0],
               "pp2": pools.run(2, check, model, 1, False, 1, 2)[0]}
    for name, r in results.items():
        assert r["run_gap"] < 1e-6 and r["state_gap"] < 4 * envelope, (name, r, envelope)
        assert r["c_untouched"], name


def test_megatron_moe_models_equal_the_transformers_backend(pools, tmp_path_factory):
    """A Qwen3-MoE model (attention and lm_head adapters: neither backend adapts experts, so
    train_mlp is refused on both) at one rank, EP2, TP2 + SP x EP2 and PP2 x EP2 equals the
    hf backend as the dense layouts do (rel 1e-5; states 4x the envelope). Under expert
    parallelism the experts' all-to-alls are collective over the replicas, so every replica
    runs every call (engine.tinker.compute `every_replica`): batches of fewer rows than
    replicas, a forward-only call and a replica without a backward row run at EP2 and equal
    the hf backend (states: the first AdamW steps from one row, m / sqrt(v) near +-1 where a
    gradient is near zero, held to 1e-4; measured 1.6e-5 at one rank too). Control: the DP
    gradient sum dropped at EP2."""
    moe = build_eos_model(str(tmp_path_factory.mktemp("tinker_moe") / "qwen3_moe"),
                          arch="qwen3_moe")
    specs = tinker_check.MOE_SPECS
    reference = tinker_check.exercise(_hf_adapters(moe), specs=specs)
    envelope = _gap(tinker_check.exercise(_hf_adapters(moe), specs=specs, reverse=True)[
        "states"], reference["states"])
    assert 0 < envelope < 1e-3, envelope
    runs = {"one rank": pools.run(1, CHECK, moe, 1, False, specs=specs)[0],
            "ep2": pools.run(2, CHECK, moe, 1, False, ep=2, specs=specs)[0],
            "tp2 + sp x ep2": pools.run(4, CHECK, moe, 2, True, ep=2, specs=specs)[0],
            "pp2 x ep2": pools.run(4, CHECK, moe, 1, False, pp=2, ep=2, specs=specs)[0]}
    gaps = {name: {k: _gap(r[k], reference[k]) for k in RUN + ("states",)}
            for name, r in runs.items()}
    assert all(g[k] < TOL for g in gaps.values() for k in RUN), gaps
    assert all(g["states"] < 4 * envelope for g in gaps.values()), (envelope, gaps)
    few = tinker_check.few_rows(_hf_adapters(moe), specs)
    got = pools.run(2, FEW, moe, 1, False, ep=2, specs=specs)[0]
    assert max(_gap(got[k], few[k]) for k in ("losses", "logprobs", "grad_norms")) < TOL
    assert _gap(got["states"], few["states"]) < 1e-4
    assert len(few["losses"]) == 3 and len(few["grad_norms"]) == 2
    assert few["raised"] and got["raised"]
    assert "mixture-of-experts" in got["unadapted_mlp"]
    control = pools.run(2, CHECK, moe, 1, False, "dp", ep=2, specs=specs)[0]
    assert max(_gap(control[k], reference[k]) for k in ("logprobs", "grad_norms")) > 1e3 * TOL


@contextlib.contextmanager
def launched(model: str, state: str, nproc: int, *extra: str):
    """`megatron-sft-engine tinker --nproc-per-node NPROC --model MODEL EXTRA` (the console's
    launch through torchrun, key tml-k) until the block ends; yields {"url", "out"}. At the
    end rank 0 gets SIGTERM (it stops the other ranks) and torchrun must exit 0: every rank
    exited 0. "out" then holds the launch's output."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "tinker", "--nproc-per-node", str(nproc),
         "--model", model, "--port", str(port), "--api-key", "tml-k", "--state-dir", state,
         *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    info = {"url": f"http://127.0.0.1:{port}"}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                tinker.ServiceClient(base_url=info["url"], api_key="tml-k"
                                     ).get_server_capabilities()
                break
            except Exception:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(1)
        yield info
        _rank0(proc).send_signal(signal.SIGTERM)   # rank 0 stops the others (lockstep)
        info["out"], _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, info.get("out")   # torchrun's: every rank exited 0


def _rank0(proc: subprocess.Popen) -> psutil.Process:
    """The launched job's rank 0 (torchrun's child whose RANK is 0)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == "0":
                return child
        except psutil.Error:
            continue
    raise AssertionError("no rank 0 under the launch")


def _steps(tc, n: int) -> list[tuple[float, float]]:
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9, 10]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10, 11]}),
            types.Datum(model_input=types.ModelInput.from_ints([12, 13, 14]),
                        loss_fn_inputs={"target_tokens": [13, 14, 15]})]
    adam = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    out = []
    for _ in range(n):
        loss = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        out.append((loss, tc.optim_step(adam).result().metrics["grad_norm:mean"]))
    return out


def test_console_launch_tp2_trains_and_its_state_resumes_on_the_transformers_backend(
        model, tmp_path):
    state = str(tmp_path / "state")
    with launched(model, state, 2, "parallel.tp=2") as server:
        sc = tinker.ServiceClient(base_url=server["url"], api_key="tml-k")
        tc = sc.create_lora_training_client(base_model="llama", rank=4, seed=3).result()
        before = _steps(tc, 2)
        path = tc.save_state("two").result().path
        after = _steps(tc, 1)
        sampler = tc.save_weights_and_get_sampling_client().result()
        greedy = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(
            max_tokens=5, temperature=0.0)).result().sequences[0]
    out = server["out"]
    assert "Megatron backend, 2 ranks: tp 2 (sequence parallel on), pp 1, cp 1, ep 1, dp 1" in out
    assert before[1][0] < before[0][0]
    # the transformers backend on the same --state-dir resumes the TP2 state with AdamW's
    # moments: its next step is the TP2 server's
    server = _serve(["--model", model, "--api-key", "tml-k", "--state-dir", state])
    try:
        sc = tinker.ServiceClient(base_url=server["url"], api_key="tml-k")
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        [(loss, norm)] = _steps(resumed, 1)
        hf_greedy = resumed.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints([5, 6, 7]), 1,
            types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
    finally:
        server["stop"]()
    assert abs(loss - after[0][0]) <= TOL * abs(after[0][0]), (loss, after)
    assert abs(norm - after[0][1]) <= TOL * abs(after[0][1]), (norm, after)
    assert hf_greedy.tokens == greedy.tokens
    np.testing.assert_allclose(hf_greedy.logprobs, greedy.logprobs, rtol=TOL)
