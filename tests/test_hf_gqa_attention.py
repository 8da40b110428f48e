"""engine.generation.hf.gqa_attention: the HF backend on a CPU reads grouped KV heads in place
(SDPA's enable_gqa with the padding mask) instead of transformers' sdpa copying them
(repeat_kv). Outputs equal transformers' sdpa bitwise, on a left-padded prefill and decode over
a DynamicCache and through HFRolloutEngine's sampling; the control counts repeat_kv's copies,
which sdpa makes on every masked call and this path never does."""
from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers import AutoModelForCausalLM

from engine.generation import SamplingParams
from engine.generation.hf import gqa_attention
from engine.generation.hf.backend import HFRolloutEngine
from tools.tiny_models import build_eos_model, build_tiny_model


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> str:
    return build_eos_model(str(tmp_path_factory.mktemp("gqa") / "model"))  # 4 heads, 2 KV


@pytest.fixture
def repeat_calls(monkeypatch) -> list[int]:
    """How many times transformers' sdpa copied KV heads (its repeat_kv), appended per call."""
    calls, real = [], hf_sdpa.repeat_kv

    def counting(hidden, n_rep):
        calls.append(n_rep)
        return real(hidden, n_rep)
    monkeypatch.setattr(hf_sdpa, "repeat_kv", counting)
    return calls


def padded_batch(rows: int = 6, longest: int = 20):
    """Left-padded token ids [rows, longest] and mask (rows of different lengths)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (rows, longest), generator=gen)
    mask = torch.ones(rows, longest, dtype=torch.long)
    for i in range(rows):
        mask[i, :2 * i] = 0
    return ids, mask


def prefill_and_decode(model, ids, mask, steps: int = 5) -> torch.Tensor:
    """Logits [steps + 1, rows, vocab]: the prefill's last position, then greedy decode steps
    over the model's DynamicCache with the growing mask."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits, cache, nxt = [out.logits[:, -1]], out.past_key_values, positions[:, -1:] + 1
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, position_ids=nxt,
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            cache, nxt = out.past_key_values, nxt + 1
    return torch.stack(logits)


def test_equals_sdpa_bitwise_without_copying_heads(gqa_dir, repeat_calls):
    model = AutoModelForCausalLM.from_pretrained(gqa_dir).eval()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = padded_batch()
    ref = prefill_and_decode(model, ids, mask)
    sdpa_copies = len(repeat_calls)
    # control: sdpa copies K and V in each of the 2 layers on all 6 masked calls
    assert sdpa_copies == 2 * 2 * 6
    assert gqa_attention.use_cpu_gqa(model)
    assert model.config._attn_implementation == gqa_attention.ATTENTION
    got = prefill_and_decode(model, ids, mask)
    assert len(repeat_calls) == sdpa_copies          # no copy on the switched model
    assert torch.equal(got, ref)
    # the control moves: a batch without its padding mask gives other logits
    assert not torch.equal(prefill_and_decode(model, ids, torch.ones_like(mask)), ref)


def test_models_it_does_not_switch(tmp_path):
    heads_equal = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        str(tmp_path / "mha"), "llama", hidden=32, layers=1, heads=4, kv_heads=4, seed=0))
    assert not gqa_attention.use_cpu_gqa(heads_equal)
    assert heads_equal.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        str(tmp_path / "eager"), "llama", hidden=32, layers=1, heads=4, kv_heads=2, seed=0),
        attn_implementation="eager")
    assert not gqa_attention.use_cpu_gqa(eager)
    assert eager.config._attn_implementation == "eager"


def test_special_keywords_go_to_transformers_sdpa(monkeypatch):
    seen = []
    monkeypatch.setattr(gqa_attention, "sdpa_attention_forward",
                        lambda *a, **kw: seen.append(sorted(kw)) or ("sdpa", None))
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    bias = torch.zeros(1, 4, 3, 3)
    assert gqa_attention.gqa_sdpa(module, q, kv, kv, None, position_bias=bias)[0] == "sdpa"
    assert gqa_attention.gqa_sdpa(module, q, q, q, None)[0] == "sdpa"      # no grouped heads
    assert len(seen) == 2 and "position_bias" in seen[0]
    out, _ = gqa_attention.gqa_sdpa(module, q, kv, kv, None)            # causal prefill, ours
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1), is_causal=True)
    assert len(seen) == 2 and torch.equal(out, ref.transpose(1, 2).contiguous())


def test_rollout_engine_samples_as_with_sdpa(gqa_dir, repeat_calls):
    engine = HFRolloutEngine(gqa_dir, device="cpu")
    assert engine.model.config._attn_implementation == gqa_attention.ATTENTION
    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seeds=[1, 2, 3, 4])
    got = [(g.response_ids, g.response_logprobs) for g in engine.generate(prompts, params)]
    assert not repeat_calls
    engine.model.set_attn_implementation("sdpa")
    ref = [(g.response_ids, g.response_logprobs) for g in engine.generate(prompts, params)]
    assert repeat_calls                               # the reference did copy
    assert got == ref


def test_gradients_equal_sdpa_through_a_padded_batch(gqa_dir, repeat_calls):
    """The Tinker service trains through the switched model (engine.tinker.service): a
    left-padded batch's loss and every parameter's gradient equal transformers' sdpa's
    (torch's CPU kernel with the mask: bitwise here; held to rel 1e-6)."""
    ids, mask = padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def loss_and_grads(model):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        loss = (logits.log_softmax(-1)[..., 7] * mask).sum() / mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    model = AutoModelForCausalLM.from_pretrained(gqa_dir)
    ref_loss, ref = loss_and_grads(model)
    assert len(repeat_calls) == 2 * 2                 # control: sdpa copied K, V in 2 layers
    assert gqa_attention.use_cpu_gqa(model)
    loss, got = loss_and_grads(model)
    assert len(repeat_calls) == 2 * 2
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in got.items():
        scale = ref[name].abs().max().clamp(min=1e-30)
        assert (grad - ref[name]).abs().max() <= 1e-6 * scale, name
    assert any(ref[n].abs().max() > 0 for n in ref if "k_proj" in n)   # keys do get gradients
