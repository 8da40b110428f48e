"""The engine's promise: every layout gives the single-process loss, grad norm and parameters.

One reference run (1 process, micro-batch = global batch of 16) and runs at 2, 4 and 8
ranks (on the session's rank pool, tests/pool.py, as torchrun would run the script) that each
loop over several layouts inside the same processes (tests/multirank/sft_invariance.py), all five aggregation modes (token-mean and seq-mean-token-mean for the
sequence-parallel and recomputation layouts), 3 Adam steps, fp32, same HF weights.

Tolerance: relative 1e-5 on per-step loss, grad norm and final parameters (parameters relative
to each tensor's largest value). Reduction order differs between layouts (fp32 sums of ~500
tokens, all-reduce trees), giving observed differences of 1e-8..1e-6. Adam eps is 1e-4 in the
harness: with eps 1e-8, parameters whose gradient is ~1e-8 get updates of size ~lr that flip
with reduction-order noise, which would hide real bugs under a loose tolerance.
"""

import pytest

from tests.launch import result_lines
from tests.multirank.muon_check import MUON_RUNS
from tests.multirank.sft_invariance import harness_models

# the module fixture runs four multi-rank runs inside the first test's setup
pytestmark = pytest.mark.timeout(2400)

SCRIPT = "tests/multirank/sft_invariance.py"
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm")
TWO_MODES = "modes=token-mean/seq-mean-token-mean"
TOL = 1e-5
# spec: tp,pp,vpp,cp,micro_batch_size[,flags]. All five aggregation modes run where the layout
# changes what is counted where (the single process, DP2 and DP4 with GA, CP2, packing, DP4
# with token-budget micro-batches): the per-sequence weights come from counts over the DP
# group. Layouts that only shard the model (TP, PP, VPP, their products with DP2) or repeat an
# already covered split at a larger size (DP8, CP8, CP2 x DP4) run token-mean and
# seq-mean-token-mean (a token count and a sequence count), as the sequence-parallel and
# recomputation layouts always did (36 engine builds fewer than five modes everywhere).
LAUNCHES = {
    1: ["1,1,0,1,16", "1,1,0,1,3", "1,1,0,1,1"],           # reference, GA uneven, GA 16
    # DP2, TP2, PP2, CP2, DP2 with packing
    # TP2 + Megatron SP; TP2 + SP + GA with full recompute; DP2 with selective recompute;
    # negative controls (bug=...): SP without the TP sum of norm grads, recompute with a
    # detached checkpoint input (full and selective)
    2: ["1,1,0,1,3", f"2,1,0,1,16,{TWO_MODES}", f"1,2,0,1,4,{TWO_MODES}", "1,1,0,2,16",
        "1,1,0,1,16,packing",
        f"2,1,0,1,16,sp+{TWO_MODES}", f"2,1,0,1,3,sp+recompute=full+{TWO_MODES}",
        f"1,1,0,1,3,recompute=selective+{TWO_MODES}",
        "2,1,0,1,16,sp+bug=spnorm+modes=token-mean",
        "1,1,0,1,3,recompute=full+bug=detach+modes=token-mean",
        "1,1,0,1,3,recompute=selective+bug=detach+modes=token-mean"],
    # DP4, TP2xDP2, PP2xDP2, PP2xVPP2xDP2, TP2xPP2, CP2xTP2, CP2xPP2,
    # DP4 unbalanced with token-budget (padded) micro-batches
    # TP2 + SP + CP2; TP2 x PP2 + SP, packed, block recompute; TP2 + SP + CP2 packed with
    # selective recompute
    4: ["1,1,0,1,2", *(f"{spec},{TWO_MODES}" for spec in ("2,1,0,1,3", "1,2,0,1,2",
                                                          "1,2,2,1,2", "2,2,0,1,3",
                                                          "2,1,0,2,4", "1,2,0,2,4")),
        "1,1,0,1,16,nobalance+tokens=40",
        f"2,1,0,2,4,sp+{TWO_MODES}", f"2,2,0,1,3,sp+packing+recompute=block+{TWO_MODES}",
        "2,1,0,2,16,sp+packing+recompute=selective+modes=token-mean"],
    # DP8, DP2xTP2xPP2, CP8, CP2xDP4 balanced with token-budget micro-batches and packing;
    # TP2 x PP2 x VPP2 x DP2 with SP and full recompute (interleaved schedule)
    8: [f"1,1,0,1,1,{TWO_MODES}", f"2,2,0,1,3,{TWO_MODES}", f"1,1,0,8,16,{TWO_MODES}",
        f"1,1,0,2,16,packing+tokens=48+{TWO_MODES}",
        "2,2,2,1,2,sp+recompute=full+modes=token-mean"],
}
# Qwen3-MoE (2 layers, 8 experts, top-2; router aux loss off) in the same launches: its own
# single-process reference; EP2; EP2 x DP2, EP2 x PP2, EP2 x TP2 (+SP); negative control:
# expert gradients averaged over the expert-data-parallel group instead of summed.
# With the load-balancing loss on (aux=0.01): DP2 and DP2 x EP2, which cut the same
# micro-batches (dp 2, micro-batch 4): compared with each other, not the reference.
MOE_MODES = "modes=token-mean/seq-mean-token-mean"
AUX = "aux=0.01+z=0.01+modes=token-mean"
# Token dropping (expert capacity 0.5): not layout-invariant by design (engine.config.moe_settings),
# compared with the dropless EP2 run of the same launch.
CAP = "1,1,0,1,4,moe+ep=2+cap=0.5+modes=token-mean"
MOE_SPECS = {
    1: [f"1,1,0,1,16,moe+{MOE_MODES}"],
    2: [f"1,1,0,1,4,moe+ep=2+{MOE_MODES}", f"1,1,0,1,4,moe+{AUX}", f"1,1,0,1,4,moe+ep=2+{AUX}",
        *(f"1,1,0,1,4,moe+{ep}auxtype={t}+{AUX}" for t in ("seq_aux_loss", "global_aux_loss")
          for ep in ("", "ep=2+")),
        CAP],
    4: [f"1,1,0,1,2,moe+ep=2+{MOE_MODES}", f"1,2,0,1,4,moe+ep=2+{MOE_MODES}",
        f"2,1,0,1,4,moe+ep=2+sp+{MOE_MODES}", "1,1,0,1,2,moe+ep=2+bug=expertgrad+modes=token-mean"],
}
# Gradient-reduce and parameter-gather overlap on (flag ov: engine.training.comm_overlap,
# 0.02 MiB buckets, so several reductions overlap the backward): DP2 with GA; TP2+SP x DP2,
# PP2 x VPP2 x DP2 (interleaved schedule with its p2p overlap), CP2 x DP2, EP2 x DP2 (MoE);
# negative control: the final parameters read without finishing the deferred all-gather.
OV = "ov+modes=token-mean"
OVERLAP_SPECS = {
    2: [f"1,1,0,1,3,{OV}", "1,1,0,1,3,ov+bug=nogather+modes=token-mean"],
    4: [f"2,1,0,1,3,sp+{OV}", f"1,2,2,1,2,{OV}", f"1,1,0,2,4,{OV}", f"1,1,0,1,2,moe+ep=2+{OV}"],
}
# optim.name=muon (megatron-core's Muon, tests/multirank/muon_check.py), token-mean: the
# single process against the plain formulas (muonref) and as the reference of DP2 with GA,
# TP2, PP2 (dense) and EP2 (MoE, its own single-process Muon reference); TP2 with megatron-core's
# default tp_mode blockwise, which orthogonalizes each TP shard alone (layout-dependent).
# "lw": under megatron-core's layer-wise distributed optimizer (optim.distributed_optimizer=true
# with Muon): DP2 with GA, DP2 x EP2, TP2+SP x DP2, DP4 x EP2 (experts dealt over 2 expert-DP
# ranks).
MUON = "modes=token-mean"
MUON_SPECS = {
    1: [f"1,1,0,1,16,muonref+{MUON}", f"1,1,0,1,16,moe+muon=duplicated+{MUON}"],
    2: [f"1,1,0,1,3,muon=duplicated+{MUON}", f"2,1,0,1,16,muon=duplicated+{MUON}",
        f"1,2,0,1,4,muon=duplicated+{MUON}", f"1,1,0,1,4,moe+ep=2+muon=duplicated+{MUON}",
        f"2,1,0,1,16,muon=blockwise+{MUON}", f"1,1,0,1,3,muon=duplicated+lw+{MUON}",
        f"1,1,0,1,4,moe+ep=2+muon=duplicated+lw+{MUON}",
        f"1,1,0,1,3,muon=duplicated+lw+bug=nolwgather+{MUON}"],
    4: [f"2,1,0,1,8,sp+muon=duplicated+lw+{MUON}", f"1,1,0,1,2,moe+ep=2+muon=duplicated+lw+{MUON}"],
} if MUON_RUNS else {}
# optim.fused=true (torch's fused AdamW under megatron's distributed optimizer,
# engine.training.fused_adamw) at DP2 with GA, against the unfused single process.
FUSED_SPECS = {2: ["1,1,0,1,3,fused+modes=token-mean"]}
for _extra in (MOE_SPECS, OVERLAP_SPECS, MUON_SPECS, FUSED_SPECS):
    for _world, _specs in _extra.items():
        LAUNCHES[_world] = LAUNCHES[_world] + _specs


@pytest.fixture(scope="module")
def invariance_runs(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_inv")
    model, moe = harness_models(str(root))   # initializer_range 0.4: see its docstring
    ref = str(root / "reference.pt")
    results, controls = {}, {}
    for world, specs in LAUNCHES.items():
        proc = pools.script(world, SCRIPT, model, ref, *specs, timeout=1500,
                            env={"INV_MOE_MODEL_DIR": moe})
        assert proc.returncode == 0, f"world {world} run failed"
        results[world] = result_lines(proc.stdout)
        controls[world] = result_lines(proc.stdout, "CONTROL ")
    return results, controls


def spec_modes(spec: str) -> tuple[str, ...]:
    """The aggregation modes a spec runs (flag modes=A/B, else all five)."""
    flags = spec.split(",")[5].split("+") if spec.count(",") >= 5 else []
    chosen = [f.split("=", 1)[1] for f in flags if f.startswith("modes=")]
    return tuple(chosen[0].split("/")) if chosen else MODES


def is_control(spec: str) -> bool:
    """A deliberately broken run (flag bug=...): it must NOT match the reference."""
    return "bug=" in spec


def test_every_layout_and_mode_reported(invariance_runs):
    results, _ = invariance_runs
    for world, specs in LAUNCHES.items():
        got = {(r["spec"], r["mode"]) for r in results[world]}
        assert got == {(s, m) for s in specs for m in spec_modes(s)}, world


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_loss_grad_norm_and_params_match_reference(invariance_runs, world):
    results, _ = invariance_runs
    for r in results[world]:
        if r.get("reference"):
            assert all(x > 0 for x in r["grad_norm"])
            continue
        if (is_control(r["spec"]) or "aux=" in r["spec"] or "cap=" in r["spec"]
                or "muon=blockwise" in r["spec"]):
            continue
        where = f"world={world} spec={r['spec']} mode={r['mode']}"
        assert r["loss_rel"] <= TOL, (where, r["loss"])
        assert r["grad_norm_rel"] <= TOL, (where, r["grad_norm"])
        assert r["param_rel"] <= TOL, where


def test_loss_actually_changes_over_steps(invariance_runs):
    """Guards against a harness that compares untrained models: the three losses differ."""
    results, _ = invariance_runs
    ref = next(r for r in results[1] if r.get("reference") and r["mode"] == "token-mean")
    assert len(set(round(x, 6) for x in ref["loss"])) == 3


@pytest.mark.parametrize("world", [2, 4, 8])
def test_negative_control_mean_of_means_is_caught(invariance_runs, world):
    """The classic bug (per-micro-batch token means averaged over GA and DP) on the same data
    gives a loss the comparator above would reject."""
    _, controls = invariance_runs
    (c,) = controls[world]
    rel = abs(c["mean_of_means"] - c["reference_loss"]) / c["reference_loss"]
    assert rel > 100 * TOL, c


@pytest.mark.parametrize("world", [2, 4, 8])
def test_negative_control_sp_duplicate_counting_gives_1_over_cp(invariance_runs, world):
    """Counting tokens over DP x CP (every CP rank counts the same sequences) divides the
    token-mean loss by cp: the bug the GlobalLossNormalizer's DP-only reduction prevents."""
    _, controls = invariance_runs
    (c,) = controls[world]
    assert c["dpcp_count"] == pytest.approx(c["reference_loss"] / c["cp"], rel=1e-5), c


@pytest.mark.parametrize("bug", ["sp+bug=spnorm", "recompute=full+bug=detach",
                                 "recompute=selective+bug=detach"])
def test_negative_controls_sp_and_recompute_are_caught(invariance_runs, bug):
    """The classic bugs of the two features, run at world 2 with the harness's own comparator:
    sequence parallelism whose norm-weight gradients (each TP rank's sequence slice) are not
    summed over TP, and recomputation whose checkpointed layers get a detached input (no
    gradient reaches them or anything before them). Both must miss the reference by far more
    than the tolerance (grad norm and final parameters)."""
    results, _ = invariance_runs
    (r,) = [r for r in results[2] if bug in r["spec"]]
    assert r["grad_norm_rel"] > 100 * TOL, r
    assert r["param_rel"] > 100 * TOL, r


def test_overlap_layouts_ran_and_match(invariance_runs):
    """Every overlap spec reported (the generic comparison above checks them at 1e-5), and
    the negative control: with overlap_param_gather an optimizer step leaves the other DP
    ranks' shards of the parameters stale until the next forward; reading them without
    TrainEngine.gather_params misses the reference by far more than the tolerance, while
    the loss and grad norm of the same run still match."""
    results, _ = invariance_runs
    for world, specs in OVERLAP_SPECS.items():
        got = {r["spec"] for r in results[world]}
        assert set(specs) <= got, world
    (r,) = [r for r in results[2] if "bug=nogather" in r["spec"]]
    assert r["param_rel"] > 100 * TOL, r
    assert r["loss_rel"] <= TOL and r["grad_norm_rel"] <= TOL, r


def test_negative_control_expert_grads_averaged_over_expert_dp_is_caught(invariance_runs):
    """EP2 x DP2 with expert gradients divided by the expert-data-parallel size (2) after
    megatron's reduction: the classic wrong-group/averaging bug on expert weights. It must
    miss the reference by far more than the tolerance."""
    results, _ = invariance_runs
    (r,) = [r for r in results[4] if "bug=expertgrad" in r["spec"]]
    assert r["grad_norm_rel"] > 100 * TOL, r
    assert r["param_rel"] > 100 * TOL, r


@pytest.mark.skipif(not MUON_RUNS, reason="optim.name=muon does not run here (emerging-optimizers "
                                           "missing or megatron-core >= 0.17)")
def test_muon_equals_its_formulas_is_layout_invariant_and_differs_from_adamw(invariance_runs):
    """optim.name=muon: at 1 process (fp32) every step's parameters equal the plain Muon +
    AdamW formulas (tests/muon_reference.py) and the grad norm theirs; DP2, TP2, PP2 and EP2
    matched the 1-process Muon run above (test_loss_grad_norm_and_params_match_reference);
    Muon trains another model than AdamW from the first update; megatron-core's blockwise
    tp_mode at TP2 misses the TP1 run by far more than the tolerance."""
    results, _ = invariance_runs
    (ref,) = [r for r in results[1] if "muonref" in r["spec"]]
    assert ref["muon_formula_rel"] <= TOL and ref["muon_grad_norm_rel"] <= TOL, ref
    adamw = next(r for r in results[1] if r["spec"] == "1,1,0,1,16" and r["mode"] == "token-mean")
    assert ref["loss"][0] == pytest.approx(adamw["loss"][0], rel=TOL)
    assert abs(ref["loss"][2] - adamw["loss"][2]) > 100 * TOL * adamw["loss"][2], (ref, adamw)
    got = {r["spec"] for w in (2, 4) for r in results[w] if "muon=duplicated" in r["spec"]}
    assert got == {s for w in (2, 4) for s in MUON_SPECS[w] if "duplicated" in s}, got
    (block,) = [r for r in results[2] if "muon=blockwise" in r["spec"]]
    assert block["param_rel"] > 100 * TOL, block
    # the layer-wise distributed optimizer without its all-gather: rank 0's copies of the
    # parameters rank 1 updated stay stale (negative control of the "lw" runs above)
    (stale,) = [r for r in results[2] if "bug=nolwgather" in r["spec"]]
    assert stale["param_rel"] > 100 * TOL, stale


def test_router_aux_loss_is_invariant_to_ep_at_the_same_micro_batches(invariance_runs):
    """moe.aux_loss_coeff > 0 and moe.z_loss_coeff > 0 (engine.training.router_losses), for each of
    megatron's aux_loss, seq_aux_loss and global_aux_loss: DP2 (ep 1) and DP2 x EP2 cut the
    same micro-batches, so the loss, grad norm and logged moe/aux_loss and moe/z_loss agree;
    the router losses really act (grad norm differs from the same layout without them) and
    the three types give different values."""
    results, _ = invariance_runs
    for aux_type in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        runs = [r for r in results[2] if "aux=" in r["spec"]
                and aux_type_of(r["spec"]) == aux_type]
        assert len(runs) == 2, aux_type
        _check_router_loss_pair(runs)
    plain = next(r for r in results[2] if r["spec"].startswith("1,1,0,1,4,moe+ep=2+modes")
                 and r["mode"] == "token-mean")
    base = next(r for r in results[2] if r["spec"] == f"1,1,0,1,4,moe+{AUX}")
    assert abs(base["grad_norm"][0] - plain["grad_norm"][0]) > 100 * TOL * plain["grad_norm"][0]
    assert all(1.0 <= m["moe/expert_load_max_over_mean"] <= 8.0 for m in base["moe"])
    first = {aux_type_of(r["spec"]): r["moe"][0]["moe/aux_loss"] for r in results[2]
             if "aux=" in r["spec"] and "ep=2" not in r["spec"]}
    assert len({round(v, 6) for v in first.values()}) == 3, first


def aux_type_of(spec: str) -> str:
    return next((f.split("=")[1] for f in spec.split(",")[5].split("+")
                 if f.startswith("auxtype=")), "aux_loss")


def _check_router_loss_pair(runs: list) -> None:
    """ep 1 and ep 2 at the same dp and micro-batches: loss, grad norm, moe metrics agree."""
    base, other = runs
    for key in ("loss", "grad_norm"):
        for x, y in zip(other[key], base[key]):
            assert x == pytest.approx(y, rel=TOL), (other["spec"], key)
    for m, mb in zip(other["moe"], base["moe"]):
        for key in ("moe/aux_loss", "moe/z_loss", "moe/expert_load_max_over_mean"):
            assert m[key] == pytest.approx(mb[key], rel=TOL), (other["spec"], key)
        assert m["moe/z_loss"] > 0 and "moe/dropped_token_fraction" not in m


def test_capacity_factor_drops_tokens_and_logs_the_fraction(invariance_runs):
    """moe.capacity_factor=0.5 at EP2 (2 ranks): every step drops a share of the top-k
    assignments (an expert keeps at most ceil(0.5 x tokens x k / experts) of a micro-batch's
    assignments: about half or more are dropped), logged as moe/dropped_token_fraction, and the
    loss differs from the dropless run of the same layout from the first step."""
    results, _ = invariance_runs
    (cap,) = [r for r in results[2] if r["spec"] == CAP]
    dropless = next(r for r in results[2] if r["spec"].startswith("1,1,0,1,4,moe+ep=2+modes")
                    and r["mode"] == "token-mean")
    assert len(cap["moe"]) == 3
    for m in cap["moe"]:
        assert 0.4 <= m["moe/dropped_token_fraction"] < 1.0, m
    assert abs(cap["loss"][0] - dropless["loss"][0]) > 100 * TOL * dropless["loss"][0]
