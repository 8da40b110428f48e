"""DPO's single-process parts: the pair plan keeps a pair's sides in one micro-batch, the loss
function refuses split pairs, the chain-rule coefficients equal autograd through the pair loss,
and the dpo.* keys are validated by name before any process group (tests/test_dpo.py runs
the training itself)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config.dpo_settings import DPOConfig, dpo_problems
from engine.config.loading import load_config
from engine.dpo.pair_loss import LOSS_TYPES, PairLossSettings, pair_gradients, pair_terms
from engine.training.plan import plan_mini_batch


@pytest.mark.parametrize("dp,mbs,tokens", [(1, 1, None), (2, 3, None), (4, 1, None),
                                           (2, 8, 50), (3, 2, 90), (8, 1, 40)])
def test_plan_keeps_pairs_together(dp, mbs, tokens):
    lengths = [5 + (7 * i) % 31 for i in range(26)]      # 13 pairs of uneven sides
    units = [[2 * k, 2 * k + 1] for k in range(13)]
    plan = plan_mini_batch(lengths, dp, True, mbs, tokens, units)
    seen = []
    for rank in plan.ranks:
        assert len(rank) == plan.num_micro_batches
        for mb in rank:
            assert len(mb) % 2 == 0 and all(mb[i] + 1 == mb[i + 1] and mb[i] % 2 == 0
                                            for i in range(0, len(mb), 2)), mb
            if tokens is None:
                assert len(mb) <= 2 * mbs
            seen += mb
    assert sorted(seen) == list(range(26))


def test_plan_without_units_splits_pairs():
    """The negative control of the test above: the sequence plan does split pairs."""
    lengths = [5 + (7 * i) % 31 for i in range(26)]
    plan = plan_mini_batch(lengths, 2, True, 3, None)
    split = [mb for rank in plan.ranks for mb in rank
             if any((i ^ 1) not in mb for i in mb)]
    assert split


def _sums(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    pc, pr = -20 * torch.rand(n, generator=g, dtype=torch.float64), \
        -20 * torch.rand(n, generator=g, dtype=torch.float64)
    rc, rr = pc + torch.randn(n, generator=g, dtype=torch.float64), \
        pr + torch.randn(n, generator=g, dtype=torch.float64)
    nc = torch.randint(1, 30, (n,), generator=g).double()
    nr = torch.randint(1, 30, (n,), generator=g).double()
    return pc, pr, rc, rr, nc, nr


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_coefficients_equal_autograd_of_the_mean_loss(kind):
    """d(mean loss)/d(sum of a side's token log-probs), as the micro-batch loss uses it, equals
    autograd through the whole formula; the value is the mean over pairs."""
    s = PairLossSettings(kind, beta=0.3, label_smoothing=0.1 if kind in
                         ("sigmoid", "robust", "simpo") else 0.0)
    pc, pr, rc, rr, nc, nr = _sums()
    terms, g_c, g_r = pair_gradients(s, pc, pr, rc, rr, nc, nr, scale=1 / 5)
    leaf_c, leaf_r = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    loss = pair_terms(s, leaf_c, leaf_r, rc, rr, nc, nr).loss.mean()
    loss.backward()
    assert torch.allclose(g_c, leaf_c.grad, rtol=1e-12) and torch.allclose(g_r, leaf_r.grad,
                                                                           rtol=1e-12)
    assert float(terms.loss.mean()) == pytest.approx(float(loss), rel=1e-12)
    assert float(g_c.abs().sum()) > 0


def test_formulas_at_known_points():
    """log 2 at zero log-ratios (sigmoid, robust), hinge 1, ipo (1/(2 beta))^2, simpo's gamma."""
    z = torch.zeros(1, dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    for kind, want in (("sigmoid", 0.6931471805599453), ("robust", 0.6931471805599453),
                       ("hinge", 1.0), ("ipo", (1 / 0.2) ** 2)):
        got = pair_terms(PairLossSettings(kind, beta=0.1), z, z, z, z, one, one).loss
        assert float(got) == pytest.approx(want, rel=1e-12), kind
    simpo = pair_terms(PairLossSettings("simpo", beta=2.0, simpo_gamma=0.5), z, z, None, None,
                       one, one).loss
    assert float(simpo) == pytest.approx(-torch.nn.functional.logsigmoid(
        torch.tensor(-0.5, dtype=torch.float64)).item(), rel=1e-12)


def test_orpo_pair_loss_equals_trl_odds_ratio_loss():
    """The orpo pair term from log-prob SUMS and completion counts equals TRL 1.16's
    ORPOTrainer.odds_ratio_loss on the means (its float32; both log1mexp branches: means
    above and below -ln 2): loss = -beta x TRL's `losses`, rewards, and the per-pair
    log_odds_ratio / log_odds_chosen whose batch means TRL logs."""
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    n_c = torch.tensor([4.0, 10.0, 1.0, 7.0], dtype=torch.float64)
    n_r = torch.tensor([2.0, 5.0, 3.0, 9.0], dtype=torch.float64)
    mean_c = torch.tensor([-0.05, -0.9, -3.0, -0.4], dtype=torch.float64)
    mean_r = torch.tensor([-0.2, -0.6, -0.01, -5.0], dtype=torch.float64)
    terms = pair_terms(PairLossSettings("orpo", beta=0.3), mean_c * n_c, mean_r * n_r, None,
                       None, n_c, n_r)
    trainer = SimpleNamespace(beta=0.3, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen, rejected, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        trainer, mean_c.float(), mean_r.float())
    assert torch.allclose(terms.loss, -losses.double(), rtol=1e-6)
    assert torch.allclose(terms.chosen_rewards, chosen.double(), rtol=1e-6)
    assert torch.allclose(terms.rejected_rewards, rejected.double(), rtol=1e-6)
    assert float(terms.extras["log_odds_ratio"].mean()) == pytest.approx(float(ratio), rel=1e-6)
    assert float(terms.extras["log_odds_chosen"].mean()) == pytest.approx(float(log_odds),
                                                                          rel=1e-6)


def _cfg(*overrides):
    cfg, _ = load_config(DPOConfig, list(overrides))
    return cfg


@pytest.mark.parametrize("overrides,needle", [
    (["dpo.loss_type=kto"], "dpo.loss_type='kto' is not valid; choose one of sigmoid, ipo"),
    (["dpo.beta=0"], "dpo.beta=0"),
    (["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], "has no label smoothing"),
    (["dpo.loss_type=robust", "dpo.label_smoothing=0.5"], "[0, 0.5) for the robust loss"),
    (["dpo.rpo_alpha=0"], "dpo.rpo_alpha=0"),
    (["dpo.simpo_gamma=1.0"], "applies only to dpo.loss_type=simpo"),
    (["dpo.loss_type=simpo", "dpo.ref_path=/x"], "reference-free"),
    (["dpo.loss_type=orpo", "dpo.ref_path=/x"], "dpo.loss_type=orpo is reference-free"),
    (["dpo.loss_type=orpo", "dpo.label_smoothing=0.1"],
     "dpo.label_smoothing=0.1: dpo.loss_type=orpo has no label smoothing"),
    (["dpo.loss_type=orpo", "dpo.rpo_alpha=0.5"], "dpo.loss_type=orpo has its own NLL term"),
    (["model.lora.rank=4", "dpo.ref_path=/x"], "adapters off"),
    (["dpo.ref_path=/nonexistent"], "dpo.ref_path=/nonexistent"),
])
def test_dpo_keys_refused_by_name(overrides, needle):
    problems = dpo_problems(_cfg(*overrides), {"model_type": "qwen3"})
    assert any(needle in p for p in problems), problems


def test_defaults_are_valid_and_logging_dir():
    cfg = _cfg()
    assert dpo_problems(cfg, {}) == []
    assert (cfg.dpo.loss_type, cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.rpo_alpha,
            cfg.dpo.ref_path) == ("sigmoid", 0.1, 0.0, None, None)
    assert cfg.logging.dir == "runs/dpo"



def test_loss_fn_on_one_rank(pools):
    """tests.multirank.dpo_check.loss_fn_checks (it needs megatron's state): a micro-batch with
    half a pair is refused; autograd through the micro-batch loss (per-token coefficients)
    equals autograd through the pair loss of the summed log-probs."""
    out = pools.run(1, "tests.multirank.dpo_check:loss_fn_checks")[0]
    assert "sides are in different micro-batches" in out["split_error"]
    assert out["grad_max_diff"] < 1e-6 * out["grad_max"] and out["grad_max"] > 0, out
    assert out["loss"] == pytest.approx(out["want"], rel=1e-6)


# ---------------------------------------------------------------- evaluation in chunks

@pytest.fixture(scope="module")
def dpo_models(tmp_path_factory):
    """The policy and the (different) reference of tests/test_dpo.py."""
    from tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("dpo_eval")
    return tuple(build_tiny_model(str(root / name), "qwen3", vocab_size=200, seed=seed,
                                  initializer_range=0.1, tokenizer=False)
                 for name, seed in (("policy", 0), ("reference", 1)))


def _direct_eval(policy_dir: str, reference_dir: str) -> tuple[dict, dict]:
    """(eval/* over all pairs, written here from transformers' logits, float64; the same
    metrics as the old evaluate computed them: each chunk's own means weighted by its share
    of the pairs)."""
    from transformers import AutoModelForCausalLM

    from tests.multirank.dpo_eval_check import CHUNK, RPO, eval_pairs

    models = [AutoModelForCausalLM.from_pretrained(d) for d in (policy_dir, reference_dir)]
    rows = []
    for p in eval_pairs(200):
        row = {}
        for name, side in (("c", p.chosen), ("r", p.rejected)):
            mask = torch.tensor(side.loss_mask, dtype=torch.bool)
            labels = torch.tensor(side.labels)
            for tag, model in zip(("", "ref_"), models):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([side.tokens])).logits[0].double()
                logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
                row[f"{tag}{name}"] = float(logp[mask].sum())
                if not tag:
                    row[f"mean_logit_{name}"] = float(logits.mean(-1)[mask].sum())
            row[f"n_{name}"] = int(mask.sum())
        delta = (row["c"] - row["ref_c"]) - (row["r"] - row["ref_r"])
        row["loss"] = float(-torch.nn.functional.logsigmoid(torch.tensor(0.5 * delta)))
        rows.append(row)

    def metrics(group: list[dict]) -> dict:
        nll = -sum(r["c"] for r in group) / sum(r["n_c"] for r in group)
        mean = (lambda f: sum(f(r) for r in group) / len(group))
        return {"eval/nll": nll, "eval/loss": mean(lambda r: r["loss"]) + RPO * nll,
                "eval/rewards/chosen": mean(lambda r: 0.5 * (r["c"] - r["ref_c"])),
                "eval/rewards/margins": mean(lambda r: 0.5 * ((r["c"] - r["ref_c"])
                                                              - (r["r"] - r["ref_r"]))),
                "eval/logps/rejected": mean(lambda r: r["r"]),
                "eval/logits/chosen": sum(r["mean_logit_c"] for r in group)
                / sum(r["n_c"] for r in group),
                "eval/logits/rejected": sum(r["mean_logit_r"] for r in group)
                / sum(r["n_r"] for r in group)}

    chunks = [rows[i:i + CHUNK] for i in range(0, len(rows), CHUNK)]
    old = {k: sum(metrics(c)[k] * len(c) / len(rows) for c in chunks) for k in metrics(rows)}
    return metrics(rows), old


@pytest.mark.parametrize("world,spec", [(1, "1,1,0,1,2"), (2, "1,1,0,1,1")])
def test_eval_metrics_are_means_over_all_eval_pairs(pools, dpo_models, world, spec):
    """engine.dpo.training.evaluate on 7 pairs in chunks of 3 (3, 3, 1 pairs of unequal
    completion token counts; one process, and DP2) equals a direct computation over all 7
    pairs from transformers' logits (rel 1e-5): eval/nll the token mean of the chosen NLL
    (sum / total tokens), eval/loss the mean pair loss + rpo_alpha x eval/nll, eval/logits/*
    token means, the per-pair metrics pair means. Negative control: the old chunk-weighted
    mean of per-chunk token means misses eval/nll, eval/loss and eval/logits/chosen by far
    more than the tolerance on the same pairs."""
    got = pools.run(world, "tests.multirank.dpo_eval_check:evaluate_chunks", *dpo_models,
                    spec)[0]
    want, old = _direct_eval(*dpo_models)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, got[k], v)
    for k in ("eval/nll", "eval/loss", "eval/logits/chosen"):
        assert abs(old[k] - want[k]) > 1e-3 * abs(want[k]), (k, old[k], want[k])


def test_orpo_eval_metrics_are_means_over_all_eval_pairs(pools, dpo_models):
    """evaluate with dpo.loss_type=orpo on the same 7 pairs in chunks of 3, 3, 1 (one process)
    equals a direct computation from transformers' logits over all 7 (rel 1e-5):
    eval/nll_loss the token mean over EVERY label of the chosen sequences (prompt included,
    TRL's ORPO NLL), eval/log_odds_chosen the pair mean of the log odds of the mean
    completion log-probs, eval/loss the mean of -0.5 logsigmoid(log odds) plus eval/nll_loss.
    Negative control: the chunk-weighted mean of per-chunk token means misses eval/nll_loss."""
    from transformers import AutoModelForCausalLM

    from tests.multirank.dpo_eval_check import CHUNK, eval_pairs

    got = pools.run(1, "tests.multirank.dpo_eval_check:evaluate_chunks", *dpo_models,
                    "1,1,0,1,2", "orpo")[0]
    model = AutoModelForCausalLM.from_pretrained(dpo_models[0])
    rows = []
    for p in eval_pairs(200):
        row = {}
        for name, side in (("c", p.chosen), ("r", p.rejected)):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([side.tokens])).logits[0].double()
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(side.labels)[:, None])
            mask = torch.tensor(side.loss_mask, dtype=torch.bool)
            row[name] = logp[:, 0][mask].mean()
            row[f"all_{name}"], row[f"n_{name}"] = float(logp.sum()), len(side.tokens)
        row["odds"] = float((row["c"] - row["r"]) - (torch.log1p(-row["c"].exp())
                                                     - torch.log1p(-row["r"].exp())))
        rows.append(row)

    def token_mean(group):
        return -sum(r["all_c"] for r in group) / sum(r["n_c"] for r in group)

    odds = torch.tensor([r["odds"] for r in rows], dtype=torch.float64)
    want = {"eval/nll_loss": token_mean(rows), "eval/log_odds_chosen": float(odds.mean()),
            "eval/loss": float(-0.5 * F.logsigmoid(odds).mean()) + token_mean(rows)}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5), (k, got[k], v)
    chunks = [rows[i:i + CHUNK] for i in range(0, len(rows), CHUNK)]
    old = sum(token_mean(c) * len(c) / len(rows) for c in chunks)
    assert abs(old - want["eval/nll_loss"]) > 1e-3 * want["eval/nll_loss"], (old, want)


def test_token_mean_logits_from_logits_and_from_hidden_states():
    """logits/* read the vocabulary mean of the logits over the real vocabulary (the first
    vocab_size rows; megatron pads the rest): from logits and from the chunked head's
    HiddenStates (the logits never built) it equals the mean of hidden @ W[:V].T, float64
    (the float32 logits' rounding: rel 1e-6). Negative control: the mean over the padded
    vocabulary differs."""
    from engine.preference.logits import token_mean_logits
    from engine.training.loss_head import HiddenStates

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(13, 8, generator=g)
    want = (hidden.double() @ weight[:11].double().T).mean(-1)
    from_hidden = token_mean_logits(HiddenStates(hidden, weight, 4), 11)
    from_logits = token_mean_logits(hidden @ weight.T, 11)
    assert from_hidden.shape == from_logits.shape == (2, 5)
    assert torch.allclose(from_hidden, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(from_logits, want, rtol=1e-6, atol=1e-6)
    padded = (hidden.double() @ weight.double().T).mean(-1)
    assert (padded - want).abs().max() > 1e-2
