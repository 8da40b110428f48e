"""The Megatron-Core behaviour that the engine's loss contract relies on (engine.training.loss,
docs/design/loss-math.md), checked with real megatron objects on a tiny GPTModel, so that a megatron-core
release that changes it fails here, by name, instead of silently rescaling every gradient.

The contract: the loss function returns the 3-tuple (weighted sum, num_tokens, report) and
`TransformerConfig.calculate_per_token_loss=True`; then
  1. the pipeline schedule divides a micro-batch loss neither by its num_tokens nor by the
     number of micro-batches, and hands the report through unchanged;
  2. DDP (average_in_collective=False) uses a gradient scaling factor of 1: gradients are
     summed over the DP x CP group;
  3. `finalize_model_grads(model, num_tokens=None)` divides nothing (the schedule passes the
     summed num_tokens; `engine.training.train_engine.finalize_grads` drops it).
So the gradient after a step is d(sum of every rank's micro-batch losses)/d(params).

Run as a script under torchrun (2 ranks, gloo) it checks these at DP2 (1F1B-free schedule,
DDP all-reduce) and PP2 (1F1B schedule) and prints one `RESULT {json}` line per check from
rank 0; the pytest tests below launch it once and assert on the lines. Negative controls on the
same data (`calculate_per_token_loss=False`, a token count given to finalize_model_grads) show
each check would catch the change it guards against.

    torchrun --nproc_per_node 2 tests/test_megatron_contract.py
"""
from __future__ import annotations

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

NUM_MICRO_BATCHES = 3
TOKENS_PER_MICRO_BATCH = 7    # returned as num_tokens: any division by it shows as 1/7
SEQ = 12
TOL = 1e-5
HF_CONFIG = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}


# ---------------------------------------------------------------- the launched script


def _init_weights(chunk, seed: int) -> None:
    """Deterministic weights (the engine builds models without initialisation)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(chunk.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.2
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else noise)


def _build(seed: int = 0, **overrides):
    """One model chunk of this rank with the engine's TransformerConfig and layer spec."""
    from models.build.factory import build_model_chunks

    (chunk,) = build_model_chunks(HF_CONFIG, **overrides)
    _init_weights(chunk, seed)
    return chunk


def _ddp(chunk, distributed_optimizer: bool = False):
    """DDP with the engine's settings (engine.training.train_engine.TrainEngine.build). The distributed
    optimizer only changes all-reduce into reduce-scatter; the all-reduce variant is checked
    so every rank holds the whole reduced gradient."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=False, average_in_collective=False)
    return DistributedDataParallel(chunk.config, ddp_config, module=chunk)


def _micro_batches(rank: int, count: int = NUM_MICRO_BATCHES):
    """`count` micro-batches (tokens, labels, per-token weights), different on every DP rank."""
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(count):
        ids = torch.randint(0, HF_CONFIG["vocab_size"], (1, SEQ + 1), generator=gen)
        weights = torch.rand((1, SEQ), generator=gen) + 0.5
        out.append((ids[:, :-1], ids[:, 1:], weights))
    return out


def _weighted_loss(logits, labels, weights):
    """Weighted per-token cross-entropy sum (TP=1: the whole vocabulary is local)."""
    import torch.nn.functional as F

    vocab = HF_CONFIG["vocab_size"]
    per_token = F.cross_entropy(logits[..., :vocab].float().reshape(-1, vocab),
                                labels.reshape(-1), reduction="none")
    return (per_token * weights.reshape(-1)).sum()


def _forward(model, tokens):
    import torch

    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
    return model(tokens, position_ids, None)


def _run_schedule(ddp_chunk, batches, num_tokens: int, finalize) -> list:
    """megatron's forward_backward_func over `batches` with a 3-tuple loss function; returns
    the schedule's output (the reports, on the last pipeline stage)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp_chunk.config.finalize_model_grads_func = finalize

    def forward_step(data_iterator, model):
        tokens, labels, weights = next(data_iterator)
        output = _forward(model, tokens)

        def loss_func(output_tensor):
            loss = _weighted_loss(output_tensor, labels, weights)
            report = {"loss": loss.detach().clone(), "mark": torch.tensor(float(len(labels)))}
            return loss, torch.tensor(num_tokens, dtype=torch.int), report

        return output, loss_func

    ddp_chunk.zero_grad_buffer()
    return list(get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=ddp_chunk,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1,
        forward_only=False))


def _main_grads(ddp_chunk) -> dict:
    return {n: p.main_grad.detach().clone() for n, p in ddp_chunk.module.named_parameters()}


def _ratio(got: dict, ref: dict) -> dict:
    """Summary of got / ref over all parameters: the least-squares scale and the relative
    error of got against ref (1.0 and ~0 when they agree)."""
    import torch

    g = torch.cat([got[n].flatten().double() for n in sorted(ref)])
    r = torch.cat([ref[n].flatten().double() for n in sorted(ref)])
    scale = float((g * r).sum() / (r * r).sum())
    rel = float((g - r).abs().max() / r.abs().max())
    return {"scale": scale, "rel": rel}


class _RecordingFinalize:
    """The engine's finalize_grads, recording the num_tokens the schedule passes."""

    def __init__(self, inner=None):
        self.inner = inner
        self.num_tokens = []

    def __call__(self, model, num_tokens=None, **kwargs):
        from engine.training.train_engine import finalize_grads

        self.num_tokens.append(None if num_tokens is None else int(num_tokens))
        return (self.inner or finalize_grads)(model, num_tokens, **kwargs)


def check_dp(rank: int, world: int) -> dict:
    """DP=world: schedule + DDP + engine finalize give the gradient of the summed losses of all
    ranks; the control with calculate_per_token_loss=False does not."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    results = {}
    batches = _micro_batches(rank)
    ref_model = _build()
    ref_total = sum(_weighted_loss(_forward(ref_model, t), l, w) for t, l, w in batches)
    ref_total.backward()
    ref = {}
    for n, p in ref_model.named_parameters():
        dist.all_reduce(p.grad)             # the gradient of the global (summed) loss
        ref[n] = p.grad.detach().clone()

    chunk = _ddp(_build())
    factors = sorted({float(b.gradient_scaling_factor) for b in getattr(chunk, "buffers", [])
                      if hasattr(b, "gradient_scaling_factor")})
    finalize = _RecordingFinalize()
    reports = _run_schedule(chunk, batches, TOKENS_PER_MICRO_BATCH, finalize)
    with torch.no_grad():
        expected_reports = [float(_weighted_loss(_forward(ref_model, t), l, w))
                            for t, l, w in batches]
    results["dp_schedule_ddp_sum"] = {
        **_ratio(_main_grads(chunk), ref), "buffer_scaling_factors": factors,
        "finalize_num_tokens": finalize.num_tokens,
        "expected_finalize_num_tokens": NUM_MICRO_BATCHES * TOKENS_PER_MICRO_BATCH,
        "reports": [float(r["loss"]) for r in reports],
        "report_keys": [sorted(r) for r in reports], "expected_reports": expected_reports,
        "world": world}

    # finalize_model_grads on known gradients: rank r holds r + 1 everywhere
    def filled():
        chunk.zero_grad_buffer()
        for p in chunk.module.parameters():
            p.main_grad.fill_(rank + 1.0)

    expected_sum = world * (world + 1) / 2
    filled()
    finalize_model_grads([chunk], None)
    no_count = sorted({float(v) for g in _main_grads(chunk).values() for v in g.unique()})
    filled()
    finalize_model_grads([chunk], torch.tensor(4, dtype=torch.int))
    with_count = sorted({round(float(v), 6) for g in _main_grads(chunk).values()
                         for v in g.unique()})
    results["finalize_num_tokens_none"] = {
        "values": no_count, "expected": [expected_sum],
        "control_values": with_count, "control_expected_if_divided": [expected_sum / (4 * world)]}

    # negative control: megatron's default (calculate_per_token_loss=False) on the same data
    control = _ddp(_build(calculate_per_token_loss=False))
    _run_schedule(control, batches, TOKENS_PER_MICRO_BATCH,
                  _RecordingFinalize(lambda m, n, **kw: finalize_model_grads(m, None, **kw)))
    results["dp_control_default_config"] = {
        **_ratio(_main_grads(control), ref),
        "expected_scale": 1.0 / (world * NUM_MICRO_BATCHES * TOKENS_PER_MICRO_BATCH)}
    return results


def check_pp(rank: int, world: int) -> dict:
    """PP=world (1F1B): M micro-batches in one schedule call give the sum of the gradients of
    M one-micro-batch calls that return num_tokens=1 (where no division can hide)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    chunk = _ddp(_build())
    batches = _micro_batches(0)
    finalize = _RecordingFinalize()
    reports = _run_schedule(chunk, batches, TOKENS_PER_MICRO_BATCH, finalize)
    got = _main_grads(chunk)
    ref = None
    for mb in batches:
        _run_schedule(chunk, [mb], 1, _RecordingFinalize())
        one = _main_grads(chunk)
        ref = one if ref is None else {n: ref[n] + one[n] for n in ref}
    chunk.config.calculate_per_token_loss = False     # negative control, same model
    try:
        _run_schedule(chunk, batches, TOKENS_PER_MICRO_BATCH, _RecordingFinalize())
        control = _ratio(_main_grads(chunk), ref)
    finally:
        chunk.config.calculate_per_token_loss = True
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    local = {"stage": ps.get_pipeline_model_parallel_rank(), **_ratio(got, ref),
             "control_scale": control["scale"], "finalize_num_tokens": finalize.num_tokens,
             "reports": [float(r["loss"]) for r in reports] if last else None,
             "report_keys": [sorted(r) for r in reports] if last else None}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    return {"pp_schedule_1f1b": {
        "stages": gathered, "expected_finalize_num_tokens_last_stage":
            NUM_MICRO_BATCHES * TOKENS_PER_MICRO_BATCH,
        "expected_control_scale": 1.0 / (NUM_MICRO_BATCHES * TOKENS_PER_MICRO_BATCH)}}


def main() -> None:
    import megatron.core

    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    rank, world = init_distributed()
    results = {}
    setup_model_parallel(ParallelLayout(world))
    results.update(check_dp(rank, world))
    setup_model_parallel(ParallelLayout(world, pp=world))
    results.update(check_pp(rank, world))
    if rank == 0:
        for name, r in results.items():
            r.update(check=name, megatron_core=megatron.core.__version__)
            print("RESULT " + json.dumps(r), flush=True)
    shutdown()


# ---------------------------------------------------------------- the pytest side


def _megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


def _changed(what: str) -> str:
    return (f"megatron-core {_megatron_version()} changed {what}; the engine's loss contract "
            f"(engine.training.loss, engine.training.train_engine.finalize_grads) relies on it: adapt the engine "
            f"(one version branch, in a compat module under parallel/) or exclude this release "
            f"from setup.py's megatron-core range")


@pytest.fixture(scope="module")
def contract(pools):
    """The RESULT lines of this file run as a script on 2 ranks (the session's rank pool,
    tests/pool.py: processes started as torchrun starts them)."""
    from tests.launch import result_lines

    proc = pools.script(2, "tests/test_megatron_contract.py", timeout=600)
    assert proc.returncode == 0, "the megatron contract run failed (output above)"
    return {r["check"]: r for r in result_lines(proc.stdout)}


def test_transformer_config_has_calculate_per_token_loss_off_by_default():
    """The engine must set the flag itself; a release that drops or renames it fails here."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert "calculate_per_token_loss" in fields, _changed(
        "TransformerConfig: no calculate_per_token_loss field")
    assert fields["calculate_per_token_loss"].default is False, _changed(
        "the default of TransformerConfig.calculate_per_token_loss")


def test_engine_config_sets_calculate_per_token_loss():
    from models.build.transformer_config import transformer_config

    assert transformer_config(HF_CONFIG).calculate_per_token_loss is True


def test_engine_finalize_grads_drops_the_token_count(monkeypatch):
    import engine.training.train_engine as te

    seen = []
    monkeypatch.setattr(te, "finalize_model_grads", lambda m, n, **kw: seen.append((n, kw)))
    te.finalize_grads(["model"], 21, pg_collection="pg", force_all_reduce=False)
    assert seen == [(None, {"pg_collection": "pg", "force_all_reduce": False})]


def test_schedule_and_ddp_sum_the_three_tuple_losses_at_dp2(contract):
    r = contract["dp_schedule_ddp_sum"]
    assert r["buffer_scaling_factors"] in ([], [1.0]), _changed(
        f"DDP's gradient scaling factor with per-token loss ({r['buffer_scaling_factors']})")
    assert abs(r["scale"] - 1.0) <= TOL and r["rel"] <= TOL, _changed(
        f"the schedule / DDP gradient scale for 3-tuple losses: got {r['scale']:.6g} x the "
        f"gradient of the summed loss (rel err {r['rel']:.3g}); 1/{NUM_MICRO_BATCHES} means "
        f"division by the micro-batch count, 1/{TOKENS_PER_MICRO_BATCH} by num_tokens, "
        f"1/{r['world']} DP averaging")


def test_schedule_passes_reports_through_and_the_summed_count_to_finalize(contract):
    r = contract["dp_schedule_ddp_sum"]
    assert r["report_keys"] == [["loss", "mark"]] * NUM_MICRO_BATCHES, _changed(
        "the schedule's output for 3-tuple loss functions (the report dicts)")
    for got, want in zip(r["reports"], r["expected_reports"]):
        assert abs(got - want) <= TOL * abs(want), _changed("the reports the schedule returns")
    assert r["finalize_num_tokens"] == [r["expected_finalize_num_tokens"]], _changed(
        "the num_tokens the schedule hands to finalize_model_grads_func")


def test_finalize_model_grads_without_count_divides_nothing(contract):
    r = contract["finalize_num_tokens_none"]
    assert r["values"] == r["expected"], _changed(
        f"finalize_model_grads(model, None): grads {r['values']}, want the DP sum "
        f"{r['expected']}")
    # control: given a count, it divides (so the check above can see a division)
    assert r["control_values"] == r["control_expected_if_divided"], r


def test_negative_control_default_config_scales_gradients(contract):
    """calculate_per_token_loss=False: the schedule divides by num_tokens and the micro-batch
    count, DDP averages over DP; the comparison above would reject it."""
    r = contract["dp_control_default_config"]
    assert abs(r["scale"] - r["expected_scale"]) <= 1e-4 * r["expected_scale"], r
    assert abs(r["scale"] - 1.0) > 0.5


def test_1f1b_schedule_sums_micro_batches_at_pp2(contract):
    r = contract["pp_schedule_1f1b"]
    stages = r["stages"]
    assert len(stages) == 2
    for s in stages:
        assert abs(s["scale"] - 1.0) <= TOL and s["rel"] <= TOL, _changed(
            f"the 1F1B schedule's handling of 3-tuple losses: stage {s['stage']} gradient is "
            f"{s['scale']:.6g} x the sum of one-micro-batch gradients")
        # control: megatron's default divides by num_tokens and the micro-batch count
        assert abs(s["control_scale"] - r["expected_control_scale"]) <= 1e-4, s
    last = next(s for s in stages if s["reports"] is not None)
    assert last["report_keys"] == [["loss", "mark"]] * NUM_MICRO_BATCHES
    assert last["finalize_num_tokens"] == [r["expected_finalize_num_tokens_last_stage"]], (
        _changed("the num_tokens the 1F1B schedule hands to finalize_model_grads_func"))


def test_launched_ranks_use_the_expected_megatron_core(contract):
    """CI's second run sets MEGATRON_CORE_EXPECTED (e.g. 0.19): the torchrun'd ranks must import
    that release, not another environment's."""
    want = os.environ.get("MEGATRON_CORE_EXPECTED")
    got = {r["megatron_core"] for r in contract.values()}
    assert got == {_megatron_version()}
    if want:
        assert all(v == want or v.startswith(want + ".") for v in got), (got, want)


# One SFT invariance launch: the layouts most sensitive to megatron's schedules and groups
# (TP2 x PP2, interleaved PP2 x VPP2 x DP2, CP2 x DP2 with packing) against the 1-process
# reference, with the harness and tolerance of tests/test_sft_invariance.py (which runs the
# full matrix in four launches). CI runs this against the newest supported megatron-core; in a
# session that also runs that full matrix (the whole suite) it would repeat its layouts on the
# same megatron-core, so it is skipped there, saying why.
SFT_SPECS = ["2,2,0,1,3", "1,2,2,1,2", "1,1,0,2,16,packing"]


def test_sft_invariance_in_one_launch(pools, tmp_path, request):
    if any(item.nodeid.startswith("tests/test_sft_invariance.py::")
           for item in request.session.items):
        pytest.skip("tests/test_sft_invariance.py runs these layouts (and the rest of the "
                    "matrix) in this session, on the same megatron-core")
    from tests.launch import result_lines
    from engine.training.loss import AGG_MODES as MODES
    from tools.tiny_models import build_tiny_model

    script = "tests/multirank/sft_invariance.py"
    model = build_tiny_model(str(tmp_path / "model"), "qwen3", vocab_size=200,
                             initializer_range=0.4, tokenizer=False)
    ref = str(tmp_path / "reference.pt")
    assert pools.script(1, script, model, ref, "1,1,0,1,16", timeout=600).returncode == 0
    proc = pools.script(4, script, model, ref, *SFT_SPECS, timeout=900)
    assert proc.returncode == 0, "SFT invariance run failed (output above)"
    results = result_lines(proc.stdout)
    assert {(r["spec"], r["mode"]) for r in results} == {(s, m) for s in SFT_SPECS
                                                         for m in MODES}
    for r in results:
        where = f"megatron-core {_megatron_version()} spec={r['spec']} mode={r['mode']}"
        assert r["loss_rel"] <= TOL and r["grad_norm_rel"] <= TOL, (where, r)
        assert r["param_rel"] <= TOL, where
    (control,) = result_lines(proc.stdout, "CONTROL ")
    rel = abs(control["mean_of_means"] - control["reference_loss"]) / control["reference_loss"]
    assert rel > 100 * TOL, control


if __name__ == "__main__":
    main()
