"""train.compile: the compiled transformer layers (models.build.compile_layers, inductor's C++
backend on this CPU host) train the same model as eager megatron.

Two launches of the SFT invariance harness (tests/multirank/sft_invariance.py, flag `compile`)
on the session's rank pool: at 1 process the eager references (dense, MoE, LoRA) and the
compiled dense and packed runs; at 2 processes compiled runs at TP2 + SP, PP2 x VPP2, CP2,
packing (DP2, TP2 + SP, CP2), EP2 (MoE: attention and router compiled, experts eager) and
LoRA, each compared with its eager
1-process reference: per-step loss and grad norm and the final parameters, fp32, relative 1e-5
(the harness's comparator, token-mean). Negative control: a run whose attention scale is 1 %
off misses the reference by far more than the tolerance.
Also: the run's compile counters are real (graphs compiled, no graph break in a dense layer),
and train.compile is validated by name.
"""
import pytest

from tests.launch import result_lines
from tests.multirank.sft_invariance import harness_models

pytestmark = pytest.mark.timeout(900)

SCRIPT = "tests/multirank/sft_invariance.py"
TOL = 1e-5
TM = "modes=token-mean"
LAUNCHES = {
    # eager references (dense, LoRA, MoE), the negative control (the comparator's sensitivity:
    # an eager run, since compiling it too would cost seconds and prove nothing more), then
    # the compiled dense run
    1: [f"1,1,0,1,16,{TM}", f"1,1,0,1,16,lora+{TM}", f"1,1,0,1,16,moe+{TM}",
        f"1,1,0,1,16,bug=attnscale+{TM}", f"1,1,0,1,16,compile+{TM}",
        f"1,1,0,1,16,packing+compile+{TM}"],
    # TP2 + SP with GA; PP2 x VPP2; CP2; DP2 packed; TP2 + SP packed; CP2 packed (Ulysses);
    # EP2 (MoE); LoRA at PP2 (2 ranks: each rank compiles its own graphs, so 2 ranks on this
    # 2-core host compile at full speed)
    2: [f"2,1,0,1,3,sp+compile+{TM}", f"1,2,2,1,4,compile+{TM}", f"1,1,0,2,4,compile+{TM}",
        f"1,1,0,1,16,packing+compile+{TM}", f"2,1,0,1,4,sp+packing+compile+{TM}",
        f"1,1,0,2,4,packing+compile+{TM}", f"1,1,0,1,4,moe+ep=2+compile+{TM}",
        f"1,2,0,1,4,lora+compile+{TM}"],
}


@pytest.fixture(scope="module")
def compile_runs(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    model, moe = harness_models(str(root))
    ref = str(root / "reference.pt")
    results = {}
    for world, specs in LAUNCHES.items():
        proc = pools.script(world, SCRIPT, model, ref, *specs, timeout=900,
                            env={"INV_MOE_MODEL_DIR": moe, "INV_CONTROLS": "0"})
        assert proc.returncode == 0, f"world {world} run failed"
        results[world] = {r["spec"]: r for r in result_lines(proc.stdout)}
        results[world]["_stdout"] = proc.stdout
    return results


def _compared(results):
    for world, specs in LAUNCHES.items():
        for spec in specs:
            if "compile" in spec and "bug=" not in spec:
                yield world, spec, results[world][spec]


def test_compiled_runs_equal_eager_at_every_layout(compile_runs):
    worst = {"loss_rel": 0.0, "grad_norm_rel": 0.0, "param_rel": 0.0}
    for world, spec, r in _compared(compile_runs):
        for key in worst:
            assert r[key] <= TOL, (world, spec, key, r[key])
            worst[key] = max(worst[key], r[key])
    print("worst relative differences, compiled vs eager:", worst)


def test_every_layout_reported(compile_runs):
    for world, specs in LAUNCHES.items():
        assert set(specs) <= set(compile_runs[world]), world


def test_negative_control_attention_scale_is_caught(compile_runs):
    """A run with the attention softmax scale 1 % off: the comparator above rejects it by far
    (loss, grad norm, parameters)."""
    r = compile_runs[1][f"1,1,0,1,16,bug=attnscale+{TM}"]
    assert r["loss_rel"] > 10 * TOL and r["grad_norm_rel"] > 100 * TOL, r
    assert r["param_rel"] > 100 * TOL, r


def test_compile_counters_in_the_run_log(compile_runs):
    """The compiled runs print their counters: graphs were really compiled (one static graph,
    then one with symbolic sizes once the sequence length changes), and a dense layer traces
    without a graph break."""
    out = compile_runs[1]["_stdout"]
    lines = [line for line in out.splitlines() if line.startswith("[compile] after step")]
    assert lines, out[-2000:]
    first = lines[0]
    assert " 0 graph breaks" in first and "graphs" in first, first
    graphs = int(first.split(": ")[1].split(" graphs")[0])
    assert graphs >= 1, first


@pytest.mark.parametrize("schema", ["sft", "rl"])
def test_bad_value_refused_naming_the_key_and_choices(schema):
    from omegaconf import OmegaConf

    from engine.config.schema import SFTConfig, value_problems
    from engine.rl.config import RLConfig

    cfg = OmegaConf.structured(SFTConfig if schema == "sft" else RLConfig)
    assert not [p for p in value_problems(cfg) if "train.compile" in p]
    cfg.train.compile = "fast"
    (problem,) = [p for p in value_problems(cfg) if "train.compile" in p]
    assert "train.compile='fast'" in problem and "null, true, false" in problem, problem


def test_compile_on_resolves_auto_by_host():
    """null (the default) and its old spelling `auto` resolve by host; the switch reads like
    the engine's other three-way switches (optim.fused, rollout.hf.*)."""
    from types import SimpleNamespace

    from engine.config.compile_settings import compile_on, compile_overrides

    train = lambda v: SimpleNamespace(compile=v)   # noqa: E731
    for null in (None, "null", "auto", "Auto"):
        assert compile_on(train(null), cuda=False) is False
        assert compile_on(train(null), cuda=True) is True
    for value, on in (("true", True), ("True", True), (True, True), ("false", False),
                      ("False", False), (False, False)):   # OmegaConf gives "True"/"False"
        assert compile_on(train(value), cuda=False) is on, value
    # this CPU host: null leaves the model eager (no compile_layers call in the build)
    assert compile_overrides(SimpleNamespace(train=train(None))) == {"compile_layers": False}
    with pytest.raises(ValueError, match="train.compile"):
        compile_on(train("sometimes"))
