"""GLM-4.5 MoE checks on the rank pool (launched by tests/test_glm4_moe.py).

1. `logits_parity(model_dir)` (one rank): the megatron model built from the tiny HF folder gives
   transformers' fp32 logits; negative control: the score-correction bias also used to weight
   the experts (`biased_weights`, the classic sigmoid-router bug) does not.
2. As a script, the SFT invariance harness (tests/multirank/sft_invariance.py, same argv:
   MODEL_DIR REF_FILE SPEC...) with two more spec flags:
     aux=C, z=C the load-balancing loss and the router z-loss (as in the harness);
     bias=R     the aux-loss-free expert-bias update at rate R (moe.bias_update_rate): the
                exported e_score_correction_bias is compared with the reference like every
                parameter, so the update must not depend on the layout;
     bug=localbias  negative control: each rank updates the bias from its own token counts
                (no all-reduce over TP x DP x CP);
     bug=padcount   negative control: padding tokens counted (no padding mask);
     mtp=S      train the MTP layer too (model.mtp.enabled, loss scale S; MODEL_DIR must hold a
                full MTP layer: tests/glm4_moe_tiny.build_glm4_moe(mtp="full")); the mtp/*
                metrics ride the results' "moe" entries; mtpdetach: cut from the trunk (RL);
     bug=mtproll    negative control: the next tokens rolled inside this rank's micro-batch
                (megatron's in-model roll: it crosses packed sequences and CP shards);
     bug=mtpmean    negative control: each micro-batch's MTP loss is its own token mean
                (megatron's per-micro-batch normalisation).
   The harness's own negative controls (mean of means, DP x CP counts) are skipped here: the
   dense harness runs them.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.multirank import sft_invariance as harness  # noqa: E402


def biased_weights(original):
    """A router function that selects like `original` but weights the experts with the
    BIASED scores (sigmoid + e_score_correction_bias): the negative control."""
    def routed(logits, topk, *args, expert_bias=None, scaling_factor=None, **kwargs):
        probs, routing_map = original(logits, topk, *args, expert_bias=expert_bias,
                                      scaling_factor=scaling_factor, **kwargs)
        biased = (torch.sigmoid(logits.float()) + expert_bias) * routing_map
        probs = biased / (biased.sum(-1, keepdim=True) + 1e-20) * (scaling_factor or 1.0)
        return probs.type_as(logits), routing_map
    return routed


def logits_parity(model_dir: str) -> dict:
    """{"max_abs": megatron vs HF, "bug_max_abs": the same with biased_weights, "scale"}."""
    from megatron.core.transformer.moe import router
    from transformers import AutoModelForCausalLM

    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_logits
    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    cfg = read_config(model_dir)
    setup_model_parallel(ParallelLayout(1))
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, SafetensorsReader(model_dir), cfg)
    for chunk in chunks:
        chunk.eval()
    tokens = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator()
                           .manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    ours = forward_logits(chunks, tokens, cfg["vocab_size"])
    original = router.topk_routing_with_score_function
    router.topk_routing_with_score_function = biased_weights(original)
    try:
        bug = forward_logits(chunks, tokens, cfg["vocab_size"])
    finally:
        router.topk_routing_with_score_function = original
    return {"max_abs": float((ours - ref).abs().max()),
            "bug_max_abs": float((bug - ref).abs().max()), "scale": float(ref.abs().max())}


def _local_counts(tokens_per_expert, expert_bias, rate, **_group):
    """megatron's get_updated_expert_bias without its all-reduce: per-rank counts (`_group`:
    the reduction group newer megatron-cores pass, 0.19's tp_dp_cp_group, unused here)."""
    with torch.no_grad():
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * rate


def _mtp_bug(bug):
    """Install an MTP negative control (module docstring); returns the undo function."""
    from engine.training import mtp, schedule

    name = "begin_forward" if bug == "mtproll" else "add_mtp_loss"
    original = getattr(schedule, name)

    def rolled(model, mb, settings):
        original(model, mb, settings)
        state = mtp.unwrap(model).mtp_inputs
        state.next_ids = torch.roll(mb.tokens, -1, dims=1)

    def mean(model, mb, settings, loss, report, vocab, chunk):
        weights = mb.extras["mtp_weights"]
        mask = mb.extras["mtp_mask"]
        mb.extras["mtp_weights"] = mask / mask.sum().clamp(min=1.0)
        try:
            return original(model, mb, settings, loss, report, vocab, chunk)
        finally:
            mb.extras["mtp_weights"] = weights

    setattr(schedule, name, rolled if bug == "mtproll" else mean)
    return lambda: setattr(schedule, name, original)


def inject(bug):
    """Install the glm-specific negative controls; returns the undo function (or None when
    `bug` is none of them)."""
    from engine.training import schedule

    # the module (the package re-exports a function of the same name)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    if bug == "localbias":
        original = finalize.get_updated_expert_bias
        finalize.get_updated_expert_bias = _local_counts
        return lambda: setattr(finalize, "get_updated_expert_bias", original)
    if bug in ("mtproll", "mtpmean"):
        return _mtp_bug(bug)
    if bug == "padcount":
        original = schedule.moe_padding_mask
        schedule.moe_padding_mask = lambda model, mb: {}
        return lambda: setattr(schedule, "moe_padding_mask", original)
    return None


def main() -> None:
    """The harness with the bias flag and controls (module docstring); every patch of the
    harness module is undone on exit (the rank pool keeps modules loaded between cases)."""
    from engine.config.moe_settings import MoEConfig, moe_overrides
    from models.hf.io import read_config

    saved = {n: getattr(harness, n) for n in ("moe_loss_overrides", "inject_bug",
                                              "negative_controls", "ADAM_EPS")}
    # the harness reads $INV_ADAM_EPS when first imported; a pool rank may have imported it
    # before this case set it
    harness.ADAM_EPS = float(os.environ.get("INV_ADAM_EPS", "1e-4"))
    config = read_config(sys.argv[1])

    def overrides(spec: str) -> dict:
        flags = spec.split(",")[5].split("+") if spec.count(",") >= 5 else []
        value = {f.split("=")[0]: float(f.split("=")[1]) for f in flags
                 if f.split("=")[0] in ("bias", "aux", "z")}
        moe = MoEConfig(bias_update_rate=value.get("bias", 0.0),
                        aux_loss_coeff=value.get("aux"), z_loss_coeff=value.get("z"))
        out = moe_overrides(SimpleNamespace(moe=moe), config)
        scale = next((float(f.split("=")[1]) for f in flags if f.startswith("mtp=")), None)
        if scale is not None:
            from engine.training.mtp import MTPTraining
            out["mtp"] = MTPTraining(scale, "mtpdetach" in flags)
        return out

    def inject_bug(state, bug):
        undo = inject(bug)
        return undo if undo is not None else saved["inject_bug"](state, bug)

    harness.moe_loss_overrides = overrides
    harness.inject_bug = inject_bug
    harness.negative_controls = lambda *args: {}
    try:
        harness.main()
    finally:
        for name, value in saved.items():
            setattr(harness, name, value)


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
