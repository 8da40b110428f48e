"""Reward-model exactness (docs/preference.md, "Reward models"): every layout equals the single
process, and the single process equals an independent transformers
AutoModelForSequenceClassification + torch AdamW loop written from the Bradley-Terry formula
(and TRL 1.16's own RewardTrainer), per step, at 1e-5 relative in fp32. Every side ends with
one or two untrained ids after its last trained (end-of-turn) token, as ChatML renders "\n"
after <|im_end|>: the references score the end-of-turn token; negative control: scoring the
last rendered id (the old rule) gives another loss and gradient at step 1.

The layouts run on the session's rank pools (tests/multirank/rm_check.py): one process (the
references: a causal LM with a seeded score row, the same model as a sequence-classification
folder, margins + centering, LoRA on the body with the head trained in full, Qwen3-MoE);
DP2 with GA, CP2, TP2 + SP with LoRA, EP2 x DP2 (MoE); PP2 x VPP2 x DP2 with GA, CP2 x DP2
packed with a token budget. Negative controls: the DP mean of per-rank pair means (localmean),
per-CP-shard scores (cpsum).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.multirank import rm_check as harness
from tests.multirank.muon_check import MUON_RUNS
from tests.test_dpo import _adapter, _pad_tokenizer
from tools.tiny_models import build_tiny_model

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5
SINGLE = ["1,1,0,1,8", "1,1,0,1,8,seqcls", "1,1,0,1,8,margin+center=0.05", "1,1,0,1,8,lora",
          "1,1,0,1,8,moe"] + (["1,1,0,1,8,muon"] if MUON_RUNS else [])
LAYOUTS = {
    2: ["1,1,0,1,2,margin+center=0.05", "1,1,0,2,8", "2,1,0,1,4,sp+lora", "1,1,0,1,8,moe+ep=2",
        "1,1,0,1,8,bug=localmean", "1,1,0,2,8,bug=cpsum"]
    + (["1,1,0,1,2,muon"] if MUON_RUNS else []),
    4: ["1,2,2,1,1,margin+center=0.05", "1,1,0,2,8,packing+tokens=120"],
}


def _sequence_classifier(causal_dir: str, out: str) -> str:
    """`causal_dir` as transformers' *ForSequenceClassification (num_labels 1) whose score row
    is the harness's seeded row: the same model as the causal LM plus rm.init_std."""
    from transformers import AutoModelForSequenceClassification

    from models.layers.heads.value import seeded_row

    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=1)
    with torch.no_grad():
        model.score.weight.copy_(seeded_row(model.config.hidden_size, harness.INIT_STD,
                                            harness.SEED))
    model.config.pad_token_id = 0
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_runs(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    causal = build_tiny_model(str(root / "causal"), "qwen3", vocab_size=200, seed=0,
                              initializer_range=0.1, tokenizer=False)
    moe = build_tiny_model(str(root / "moe"), "qwen3_moe", vocab_size=200, seed=2,
                           initializer_range=0.1, tokenizer=False)
    dirs = {"causal": causal, "moe": moe,
            "seqcls": _sequence_classifier(causal, str(root / "seqcls")),
            "moe_seqcls": _sequence_classifier(moe, str(root / "moe_seqcls"))}
    adapter = _adapter(causal, str(root / "adapter"))
    ref_file = str(root / "single.pt")
    out = {"dirs": dirs, "adapter": adapter,
           1: pools.run(1, "tests.multirank.rm_check:layouts", dirs, SINGLE, ref_file, adapter,
                        timeout=600)[0]}
    for world, specs in LAYOUTS.items():
        out[world] = pools.run(world, "tests.multirank.rm_check:layouts", dirs, specs,
                               ref_file, adapter, timeout=600)[0]
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_layout_equals_single_process(rm_runs, world):
    for spec, r in rm_runs[world].items():
        if "bug=" in spec:
            continue
        for k in harness.METRICS:
            assert r[f"{k}_rel"] <= TOL, (spec, k, r)
        # LoRA at tp2 + sp: Adam's eps amplifies the rounding of the differently ordered TP
        # sums into adapter entries with tiny gradients (tests/test_dpo.py; measured 1.9e-5)
        tol = 1e-4 if "lora" in spec and "sp" in spec else TOL
        assert r["param_rel"] <= tol, (spec, r["param_rel"])


def test_a_sequence_classifier_starts_where_the_seeded_row_does(rm_runs):
    r = rm_runs[1]["1,1,0,1,8,seqcls"]
    for k in harness.METRICS:
        assert r[f"{k}_rel"] <= TOL, (k, r)
    assert r["param_rel"] <= TOL


def test_single_process_learns(rm_runs):
    base = rm_runs[1]["1,1,0,1,8"]
    assert base["loss"][1] < base["loss"][0]
    assert all(math.isfinite(v) for k in harness.METRICS for v in base[k])
    margins = rm_runs[1]["1,1,0,1,8,margin+center=0.05"]
    assert abs(margins["loss"][0] - base["loss"][0]) > 1e-3   # margins and centering count


@pytest.mark.skipif(not MUON_RUNS, reason="optim.name=muon does not run here")
def test_muon_reward_model_trains_another_model_than_adamw(rm_runs):
    """optim.name=muon for a reward model (the layers' matrices in Muon; the score row, marked
    as an output layer, in AdamW: tests/test_muon.py): the same first loss as AdamW, another
    last loss; DP2 with GA matched it above."""
    m, a = rm_runs[1]["1,1,0,1,8,muon"], rm_runs[1]["1,1,0,1,8"]
    assert m["loss"][0] == pytest.approx(a["loss"][0], rel=TOL)
    assert abs(m["loss"][-1] - a["loss"][-1]) > 100 * TOL * abs(a["loss"][-1]), (m, a)
    assert "1,1,0,1,2,muon" in rm_runs[2]


def test_negative_control_dp_mean_of_rank_means_is_caught(rm_runs):
    """Each DP rank dividing by its own pair count doubles the loss and gradient at DP2."""
    r = rm_runs[2]["1,1,0,1,8,bug=localmean"]
    ref = rm_runs[1]["1,1,0,1,8"]
    assert r["loss"][0] == pytest.approx(2 * ref["loss"][0], rel=TOL)
    assert r["grad_norm"][0] == pytest.approx(2 * ref["grad_norm"][0], rel=TOL)


def test_negative_control_cp_shard_scores_are_caught(rm_runs):
    r = rm_runs[2]["1,1,0,2,8,bug=cpsum"]
    assert r["loss_rel"] > 100 * TOL and r["rewards/chosen_rel"] > 100 * TOL
    assert r["min_reward_rel"] > 100 * TOL


# ------------------------------------------------------------ the plain transformers loop

def _eot_ids(side) -> list[int]:
    """A side's rendered ids up to its last trained token (the end-of-turn token; the harness
    renders 1 or 2 untrained ids after it, as ChatML renders "\\n" after <|im_end|>)."""
    ids = list(side.tokens) + [side.labels[-1]]
    trained = [t + 1 for t, m in enumerate(side.loss_mask) if m]   # rendered positions
    return ids[:trained[-1] + 1]


def _rendered_ids(side) -> list[int]:
    """Every rendered id (the old rule: the last one is scored, here an untrained id)."""
    return list(side.tokens) + [side.labels[-1]]


def _score(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, 0]


def plain_loop(model_dir: str, spec: str, adapter: str | None = None, ids_of=_eot_ids):
    """{metric: [per step]}: transformers' sequence classifier (batch 1 per side: its own last
    non-pad token rule) on each side's ids up to its end-of-turn token (`ids_of`), the
    Bradley-Terry loss with margins and centering, AdamW, clip 1; TRL RewardTrainer's
    metrics."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    flags = harness.flags_of(spec)
    center = float(flags.get("center", 0.0))
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        model.base_model.model.score.weight.requires_grad_(True)   # modules_to_save=["score"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=harness.dpo_check.LR, betas=(0.9, 0.95),
                            eps=harness.dpo_check.ADAM_EPS, weight_decay=0.0)
    out = {k: [] for k in harness.METRICS}
    for pairs in harness.batches(200, flags):
        rc = torch.stack([_score(model, ids_of(p.chosen)) for p in pairs])
        rr = torch.stack([_score(model, ids_of(p.rejected)) for p in pairs])
        m = torch.tensor([p.margin or 0.0 for p in pairs])
        loss = -F.logsigmoid(rc - rr - m).mean() + center * ((rc + rr) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        rc, rr, both = rc.detach(), rr.detach(), torch.cat([rc.detach(), rr.detach()])
        for k, v in (("loss", loss.detach()), ("accuracy", (rc > rr).float().mean()),
                     ("margin", (rc - rr).mean()), ("mean_reward", both.mean()),
                     ("min_reward", both.min()), ("max_reward", both.max()),
                     ("rewards/chosen", rc.mean()), ("rewards/rejected", rr.mean())):
            out[k].append(float(v))
    return out


@pytest.mark.parametrize("spec", ["1,1,0,1,8", "1,1,0,1,8,margin+center=0.05",
                                  "1,1,0,1,8,lora", "1,1,0,1,8,moe"])
def test_single_process_equals_plain_loop(rm_runs, spec):
    """Per step at 1e-5: loss, grad norm and TRL RewardTrainer's metrics (accuracy, margin,
    mean/min/max_reward) of a plain loop scoring each side's end-of-turn token."""
    dirs = rm_runs["dirs"]
    model_dir = dirs["moe_seqcls" if "moe" in spec else "seqcls"]
    adapter = rm_runs["adapter"] if "lora" in spec else None
    ref = plain_loop(model_dir, spec, adapter)
    got = rm_runs[1][spec]
    for k in harness.METRICS:
        scale = max(max(abs(v) for v in ref[k]), 1e-2)
        for a, b in zip(got[k], ref[k]):
            assert abs(a - b) <= TOL * scale, (spec, k, got[k], ref[k])


def test_negative_control_the_last_rendered_id_is_not_what_the_engine_scores(rm_runs):
    """The old rule (score the last rendered id: ChatML's untrained newline) gives another
    loss already at step 1, and another gradient."""
    ref = plain_loop(rm_runs["dirs"]["seqcls"], "1,1,0,1,8", ids_of=_rendered_ids)
    got = rm_runs[1]["1,1,0,1,8"]
    assert abs(got["loss"][0] - ref["loss"][0]) > 1e-3 * abs(ref["loss"][0]), (got, ref)
    assert abs(got["grad_norm"][0] - ref["grad_norm"][0]) > 1e-3 * ref["grad_norm"][0]


# ---------------------------------------------------------------- TRL's own RewardTrainer

@pytest.mark.parametrize("spec", ["1,1,0,1,8", "1,1,0,1,8,margin+center=0.05"])
def test_single_process_equals_trl_reward_trainer(rm_runs, spec, tmp_path):
    """trl 1.16's RewardTrainer on the same token ids (already-tokenized rows: chosen_ids,
    rejected_ids ending on the end-of-turn token, margin), fp32 (bf16=False), AdamW, clip 1:
    per-step loss and grad norm."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    flags = harness.flags_of(spec)
    rows = [{"chosen_ids": _eot_ids(p.chosen), "rejected_ids": _eot_ids(p.rejected),
             **({"margin": p.margin or 0.0} if "margin" in flags else {})}
            for pairs in harness.batches(200, flags) for p in pairs]
    losses, norms = [], []

    class Record(RewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    class Norms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                norms.append(float(logs["grad_norm"]))

    center = float(flags["center"]) if "center" in flags else None
    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=harness.PAIRS,
                        learning_rate=harness.dpo_check.LR, lr_scheduler_type="constant",
                        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=harness.dpo_check.ADAM_EPS,
                        weight_decay=0.0, max_grad_norm=1.0, max_steps=harness.STEPS,
                        logging_steps=1, report_to=[], use_cpu=True, max_length=None,
                        save_strategy="no", optim="adamw_torch", dataloader_num_workers=0,
                        bf16=False, center_rewards_coefficient=center,
                        train_sampling_strategy="sequential")
    model = AutoModelForSequenceClassification.from_pretrained(rm_runs["dirs"]["seqcls"])
    trainer = Record(model=model, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=_pad_tokenizer(), callbacks=[Norms()])
    trainer.train()
    got = rm_runs[1][spec]
    assert len(losses) == len(norms) == harness.STEPS
    for a, b in zip(got["loss"], losses):
        assert a == pytest.approx(b, rel=TOL), (spec, got["loss"], losses)
    for a, b in zip(got["grad_norm"], norms):
        assert a == pytest.approx(b, rel=TOL), (spec, got["grad_norm"], norms)
