"""train.prefix_sharing with train.compile (issue 91): the compiled layers (models.build.
compile_layers) run prefix trees exactly and compile nothing new per tree.

One 1-process launch of tests/multirank/prefix_sharing_compile_check.py on a 2-layer Qwen3 (q/k
norms, GQA 8:2): GRPO (the log-prob stage over 3 micro-batches, each a different tree, then 3
policy updates with the full loss) and SFT (3 steps), each run eager shared, compiled unshared
and compiled shared on the same batches. Checked:
- compiled shared against eager shared: log-probs, loss, grad norm and every compared metric
  within the compile tests' tolerance (tests/test_train_compile.py: rel 1e-5);
- compiled shared against compiled unshared: within prefix sharing's (tests/test_prefix_sharing.py:
  rel 1e-5), the token ratio well under 1;
- the compile counts after each micro-batch forward: the trees' RoPE (each token's depth) and
  attention run eagerly outside the compiled regions, so after the first micro-batch of each
  grad mode no tree compiles a graph, recompiles or breaks one.
Negative controls: RoPE positions counted along the tree row (its natural order) instead of
each token's depth are caught by the same comparison; and tree rows traced into the compiled
core attention (the routing to its eager forward removed) compile a new graph for every new
tree, which the count check above would catch.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(900)

CHECK = "tests/multirank/prefix_sharing_compile_check.py"
TOL = 1e-5
LOGPROB_MICRO_BATCHES = 3   # GRPO: GROUPS prompts, micro_batch_size 1: one tree per group


@pytest.fixture(scope="module")
def launch(pools, tmp_path_factory):
    from tests.conftest import INIT_RANGE
    from tools.tiny_models import build_tiny_model

    model = build_tiny_model(str(tmp_path_factory.mktemp("qwen3_2l")), "qwen3", layers=2,
                             initializer_range=INIT_RANGE)
    proc = pools.script(1, CHECK, model, "grpo", "sft", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {"RESULT": [], "CONTROL": []}
    for line in proc.stdout.splitlines():
        tag, _, body = line.partition(" ")
        if tag in lines:
            lines[tag].append(json.loads(body))
    return ({r["objective"]: r for r in lines["RESULT"]},
            {c["kind"]: c for c in lines["CONTROL"]})


def test_compiled_shared_equals_eager_shared(launch):
    results, _ = launch
    assert sorted(results) == ["grpo", "sft"]
    for name, r in results.items():
        c = r["compiled_vs_eager"]
        assert c["logprob_rel"] < TOL and c["metric_rel"] < TOL, (name, c)
        assert len(set(c["losses"])) == 3, (name, c)   # the model trains


def test_compiled_shared_equals_compiled_unshared(launch):
    results, _ = launch
    for name, r in results.items():
        c = r["shared_vs_unshared"]
        assert c["logprob_rel"] < TOL and c["metric_rel"] < TOL, (name, c)
        assert c["ratio_off"] == 1.0 and c["ratio_on"] < 0.5, (name, c)


def _counts(micro_batches: list[dict]) -> list[tuple]:
    return [(m["graphs"], m["recompiles"], m["breaks"]) for m in micro_batches]


def test_new_trees_compile_nothing(launch):
    """GRPO's compiled shared run: 3 log-prob micro-batches (no grad), then 3 updates of the
    same 3 trees (grad). Each grad mode compiles its graphs at its first micro-batch (the
    second mode's are dynamo recompiles: the grad-mode guard); every later tree, of another
    size and shape, adds no graph, recompile or graph break."""
    results, _ = launch
    mbs = results["grpo"]["micro_batches"]
    assert len(mbs) == 4 * LOGPROB_MICRO_BATCHES and all(m["tree"] for m in mbs), mbs
    shapes = {(m["tokens"], m["runs"]) for m in mbs}
    assert len(shapes) == LOGPROB_MICRO_BATCHES, shapes   # three different trees
    counts = _counts(mbs)
    no_grad, grad = counts[:LOGPROB_MICRO_BATCHES], counts[LOGPROB_MICRO_BATCHES:]
    assert no_grad == [no_grad[0]] * len(no_grad), counts
    assert grad == [grad[0]] * len(grad), counts
    before = results["grpo"]["counts_before"]
    assert no_grad[0][0] > before["graphs"] and grad[0][2] == before["graph_breaks"], counts
    # the grad graphs are the no-grad graphs' recompiles (one per region), nothing more
    assert grad[0][0] - no_grad[0][0] == grad[0][1] - no_grad[0][1] > 0, counts
    sft = _counts(results["sft"]["micro_batches"])
    assert sft[1:] == [sft[1]] * (len(sft) - 1), sft


def test_negative_control_tree_order_positions_caught(launch):
    _, controls = launch
    c = controls["tree_positions"]
    assert c["logprob_rel"] > 1e-2 and c["metric_rel"] > 1e-2, c


def test_negative_control_traced_tree_attention_compiles_per_tree(launch):
    """Tree rows inside the compiled core attention: the chains' host bounds are baked into
    the graph, so each new tree compiles again (the check above would fail)."""
    _, controls = launch
    counts = _counts(controls["traced"]["micro_batches"])
    assert len(counts) == LOGPROB_MICRO_BATCHES, counts
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in zip(counts, counts[1:])), counts
