"""Rollout engines (HF backend, SGLang's missing-package error) and bucketed weight sync.

References are independent: a separately loaded transformers model run without cache or padding,
hand-computed bucket groupings, and a second random model whose weights are streamed in."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.rl.policy.weight_export import SyncStats, iter_buckets, tensor_bytes
from engine.rl.policy.weight_sync import sync_weights
from engine.generation import Generation, SamplingParams, make_rollout_engine
from tools.tiny_models import build_tiny_model

LAYERS = 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]  # left padding needed
EOS = 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    policy = build_tiny_model(str(root / "policy"), "qwen3", vocab_size=200, hidden=64,
                              layers=LAYERS, seed=0)
    other = build_tiny_model(str(root / "other"), "qwen3", vocab_size=200, hidden=64,
                             layers=LAYERS, seed=1, tokenizer=False)
    return policy, other


@pytest.fixture(scope="module")
def reference(model_dirs):
    """An independently loaded copy of the policy model (never touched by the engine)."""
    return AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).eval()


@pytest.fixture()
def engine(model_dirs):
    return make_rollout_engine("hf", model_dirs[0], device="cpu")


def recomputed_logprobs(model, gen: Generation, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the response tokens, one unpadded forward over prompt+response."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)[len(gen.prompt_ids) - 1:-1]
    return logp.gather(-1, torch.tensor(gen.response_ids)[:, None]).squeeze(-1)


def greedy_without_cache(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token in eos:
                break
    return ids[len(prompt):]


def test_greedy_is_deterministic_and_matches_step_by_step_argmax(engine, reference):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS, params)
    assert engine.num_generate_calls == 2
    assert len(first) == len(PROMPTS)
    for prompt, a, b in zip(PROMPTS, first, second):
        assert a.prompt_ids == prompt
        assert a.response_ids == b.response_ids
        assert a.response_ids == greedy_without_cache(reference, prompt, 8, {EOS})
        diff = (recomputed_logprobs(reference, a, 0.0) - torch.tensor(a.response_logprobs))
        assert diff.abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(engine, reference):
    """Greedy rows of a GRPO-shaped batch (each prompt 3 times, left padding) are
    transformers' `model.generate(do_sample=False)` tokens, up to and including eos."""
    batch = [p for p in PROMPTS for _ in range(3)]
    longest = max(map(len, batch))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        theirs = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                    eos_token_id=EOS, pad_token_id=0)[:, longest:]
    for gen, row in zip(engine.generate(batch, SamplingParams(max_new_tokens=8,
                                                              temperature=0.0)), theirs):
        assert gen.response_ids == row.tolist()[:len(gen.response_ids)]
        assert gen.finish_reason == "length" or gen.response_ids[-1] == EOS


def test_repeated_prompts_are_prefilled_once(engine, monkeypatch):
    """A GRPO batch (each prompt 4 times, lengths 7, 2, 4, 1) prefills each distinct prompt
    once (engine.generation.hf.group_prefill: 14 prompt tokens, where the left-padded batch
    forward took 16 x 7 = 112), and its tokens and log-probs are those of the batch forward
    (log-probs to rounding)."""
    batch = [p for p in PROMPTS for _ in range(4)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    seen: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        shared = engine.generate(batch, params)
    finally:
        hook.remove()
    prefill = [shape for shape in seen if shape[-1] > 1 or shape[0] < len(batch)]
    assert sum(rows * length for rows, length in prefill) == sum(map(len, PROMPTS))
    import engine.generation.hf.backend as backend

    monkeypatch.setattr(backend, "shared_prefill_problem", lambda _: "the batch forward")
    batched = engine.generate(batch, params)
    for a, b in zip(shared, batched):
        assert a.response_ids == b.response_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)


def test_generation_runs_without_the_cpu_runtimes_device_mode(engine):
    """On a CPU host the runtime's CudaToCpuMode (parallel.cpu_runtime) sees every torch call
    of the process; transformers' model inside generate runs with it suspended (every forward
    sees no mode; the decode loop's hundreds of small calls paid its Python handler: 0.44 s
    against 0.33 s for the trl bench's 16 x 32-token rollout), and the mode is back afterwards,
    also after a failed generate. Negative control: a forward outside generate sees the mode."""
    from parallel import cpu_runtime

    cpu_runtime.install()
    if not cpu_runtime.is_cpu_host():
        pytest.skip("a CUDA host: the runtime and its mode are not installed")
    seen: list[bool] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args: seen.append(cpu_runtime._cpu_mode_active()))
    try:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))
        assert len(seen) > 1 and not any(seen)
        with torch.no_grad():
            engine.model(torch.tensor([PROMPTS[0]]))
        assert seen[-1] is True                  # outside generate: the mode is there
        with pytest.raises(ValueError, match="outside"):
            engine.generate([[10 ** 6]], SamplingParams(max_new_tokens=2))
        assert cpu_runtime._cpu_mode_active()
    finally:
        hook.remove()


def test_stops_per_sequence_at_eos(engine):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    full = engine.generate(PROMPTS, params)
    assert all(g.finish_reason == "length" and len(g.response_ids) == 8 for g in full)
    stop_token = full[0].response_ids[2]  # make prompt 0's third greedy token the eos
    engine.eos_token_ids = [stop_token]
    cut = engine.generate(PROMPTS, params)
    for g_full, g_cut in zip(full, cut):
        if stop_token in g_full.response_ids:
            n = g_full.response_ids.index(stop_token) + 1
            assert g_cut.finish_reason == "stop" and g_cut.response_ids == g_full.response_ids[:n]
            assert g_cut.response_logprobs == pytest.approx(g_full.response_logprobs[:n], abs=1e-5)
        else:  # the other rows keep decoding after row 0 stopped
            assert g_cut.finish_reason == "length" and g_cut.response_ids == g_full.response_ids
    assert len(cut[0].response_ids) <= 3 and cut[0].finish_reason == "stop"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_independent_recomputation(engine, reference, temperature, top_p):
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, seed=123)
    gens = engine.generate(PROMPTS, params)
    assert [g.prompt_ids for g in gens] == PROMPTS
    for g in gens:
        assert 1 <= len(g.response_ids) <= 10
        assert len(g.response_logprobs) == len(g.response_ids)
        ended = g.response_ids[-1] == EOS
        assert g.finish_reason == ("stop" if ended else "length")
        assert ended or len(g.response_ids) == 10
        assert EOS not in g.response_ids[:-1]
        ref = recomputed_logprobs(reference, g, temperature)
        assert (ref - torch.tensor(g.response_logprobs)).abs().max() <= 1e-4
        if top_p < 1.0:  # every sampled token lies in the nucleus: mass strictly above < top_p
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(g.prompt_ids) - 1:-1]
            probs = torch.softmax(logits / temperature, dim=-1)
            chosen = probs.gather(-1, torch.tensor(g.response_ids)[:, None])
            assert ((probs * (probs > chosen)).sum(-1) < top_p).all()


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=7))
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=7))
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=8))
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.response_logprobs for g in a] == [g.response_logprobs for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]
    assert engine.num_generate_calls == 3


class RecordingEngine:
    """Wraps an engine and records the names of every bucket it receives."""

    def __init__(self, inner):
        self.inner, self.buckets = inner, []

    def update_weights(self, named_tensors):
        bucket = list(named_tensors)
        self.buckets.append([name for name, _ in bucket])
        self.inner.update_weights(bucket)


def test_sync_weights_of_another_model_in_buckets(engine, model_dirs):
    other = AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        target = other(ids).logits
        assert (engine.model(ids).logits - target).abs().max() > 1e-2  # negative control
    recorder = RecordingEngine(engine)
    named = list(other.named_parameters())  # tied: no lm_head.weight in the stream
    stats = sync_weights(iter(named), recorder, bucket_mb=0.01)  # 10485 bytes

    # Hand grouping (hidden 64, 8 q heads x 16, 2 kv heads, ffn 128, fp32, limit 10485 B):
    # embed 51200 alone; per layer q 32768 | k 8192 | v 8192 | o 32768 | q_norm+k_norm 128 |
    # gate 32768 | up 32768 | down 32768 | input+post norms 512 (+ final norm 256 after the last).
    assert stats.num_buckets == 1 + 9 * LAYERS == len(recorder.buckets)
    assert recorder.buckets[0] == ["model.embed_tokens.weight"]
    short = [[n.split(".", 3)[-1] for n in b] for b in recorder.buckets[1:10]]
    assert short == [["self_attn.q_proj.weight"], ["self_attn.k_proj.weight"],
                     ["self_attn.v_proj.weight"], ["self_attn.o_proj.weight"],
                     ["self_attn.q_norm.weight", "self_attn.k_norm.weight"],
                     ["mlp.gate_proj.weight"], ["mlp.up_proj.weight"], ["mlp.down_proj.weight"],
                     ["input_layernorm.weight", "post_attention_layernorm.weight"]]
    assert recorder.buckets[-1][-1] == "model.norm.weight" and len(recorder.buckets[-1]) == 3
    assert [n for b in recorder.buckets for n in b] == [n for n, _ in named]
    assert stats.num_tensors == len(named)
    assert stats.total_bytes == sum(p.numel() * 4 for _, p in named)
    assert stats.seconds > 0 and stats.gbps == pytest.approx(stats.total_bytes / stats.seconds / 1e9)
    with torch.no_grad():
        assert (engine.model(ids).logits - target).abs().max() <= 1e-6
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    gen = engine.generate([ids[0].tolist()], SamplingParams(max_new_tokens=6, temperature=0.8,
                                                            seed=1))[0]
    assert (recomputed_logprobs(other, gen, 0.8) - torch.tensor(gen.response_logprobs)).abs().max() <= 1e-4


def test_update_weights_rejects_unknown_names_and_shapes_atomically(engine):
    embed = engine.model.model.embed_tokens.weight
    before = embed.detach().clone()
    new_embed = torch.randn_like(before)
    with pytest.raises(KeyError, match="model.layers.0.mlp.not_a_weight"):
        engine.update_weights([("model.embed_tokens.weight", new_embed),
                               ("model.layers.0.mlp.not_a_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"shape \(3, 64\)"):
        engine.update_weights([("model.norm.weight", torch.ones(64)),
                               ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 64))])
    assert torch.equal(embed, before)  # nothing of a rejected bucket was written
    engine.update_weights([("lm_head.weight", new_embed)])  # tied alias writes the same tensor
    assert torch.equal(embed, new_embed)


def test_iter_buckets_hand_computed_grouping():
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(20)),            # 40 + 80 = 120 B
               ("c", torch.zeros(10, dtype=torch.bfloat16)),              # 20 B
               ("d", torch.zeros(30)),                                    # 120 B
               ("e", torch.zeros(100)),                                   # 400 B > bucket
               ("f", torch.zeros(1)), ("g", torch.zeros(0)), ("h", torch.zeros(25))]  # 4, 0, 100
    assert [tensor_bytes(t) for _, t in tensors] == [40, 80, 20, 120, 400, 4, 0, 100]
    groups = [[n for n, _ in b] for b in iter_buckets(tensors, bucket_bytes=128)]
    assert groups == [["a", "b"], ["c"], ["d"], ["e"], ["f", "g", "h"]]
    groups = [[n for n, _ in b] for b in iter_buckets(tensors, bucket_bytes=10_000)]
    assert groups == [["a", "b", "c", "d", "e", "f", "g", "h"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_buckets(tensors, bucket_bytes=0))


def test_iter_buckets_is_lazy():
    consumed = []

    def stream():
        for i in range(6):
            consumed.append(i)
            yield f"t{i}", torch.zeros(8)  # 32 B each

    buckets = iter_buckets(stream(), bucket_bytes=64)
    assert consumed == []
    assert [n for n, _ in next(buckets)] == ["t0", "t1"]
    assert consumed == [0, 1, 2]  # read one past the bucket to know it is full, no further
    assert [n for n, _ in next(buckets)] == ["t2", "t3"]
    assert consumed == [0, 1, 2, 3, 4]
    assert [[n for n, _ in b] for b in buckets] == [["t4", "t5"]]


def test_sync_stats_gbps():
    assert SyncStats(num_tensors=3, num_buckets=2, total_bytes=4_000_000_000,
                     seconds=2.0).gbps == 2.0
    assert SyncStats(num_tensors=0, num_buckets=0, total_bytes=0, seconds=0.0).gbps == 0.0


def test_sleep_frees_weights_and_wake_needs_a_full_sync(engine, reference):
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = [g.response_ids for g in engine.generate(PROMPTS, params)]
    engine.sleep()
    assert engine.is_asleep and all(p.is_meta for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights([("model.norm.weight", torch.ones(64))])
    engine.wake()
    assert not any(p.is_meta for p in engine.model.parameters())
    named = list(reference.named_parameters())
    sync_weights(iter(named[:-1]), engine, bucket_mb=1.0)  # everything but the final norm
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        engine.generate(PROMPTS, params)
    sync_weights(iter(named[-1:]), engine, bucket_mb=1.0)
    assert [g.response_ids for g in engine.generate(PROMPTS, params)] == before


def test_sglang_without_the_package_gives_a_clear_error(monkeypatch, model_dirs):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"needs the sglang package: pip install -e \.\[gpu\]; "
                                           r"on CPU use rollout.backend=hf"):
        make_rollout_engine("sglang", model_dirs[0])


def test_unknown_backend_and_bad_inputs(engine, model_dirs):
    with pytest.raises(ValueError, match=r"'trtllm' is not known; choose one of hf, vllm, sglang"):
        make_rollout_engine("trtllm", model_dirs[0])
    with pytest.raises(ValueError, match="not a local HF model directory"):
        make_rollout_engine("hf", model_dirs[0] + "/missing")
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=-1.0),
                dict(max_new_tokens=4, top_p=0.0), dict(max_new_tokens=4, top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 200]], SamplingParams(max_new_tokens=2))
    assert engine.generate([], SamplingParams(max_new_tokens=2)) == []


def test_moe_checkpoint_names_fill_fused_experts_after_wake(tmp_path):
    """A Qwen3-MoE engine (transformers keeps the experts fused in memory) takes the
    checkpoint's per-expert tensors (what the weight sync streams): after sleep/wake, a stream
    of a second model's checkpoint without one expert's up_proj leaves that name stale
    (generate refuses, naming it); the full stream gives that model's logits exactly."""
    from safetensors.torch import load_file

    policy = build_tiny_model(str(tmp_path / "moe"), "qwen3_moe", layers=2, seed=0)
    other = build_tiny_model(str(tmp_path / "moe2"), "qwen3_moe", layers=2, seed=1,
                             tokenizer=False)
    engine = make_rollout_engine("hf", policy, device="cpu")
    named = sorted(load_file(f"{other}/model.safetensors").items())
    assert any(".experts.7.up_proj.weight" in n for n, _ in named)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    target = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()(ids).logits
    assert (engine.probe_logits(ids) - target).abs().max() > 1e-2  # negative control
    engine.sleep()
    engine.wake()
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    sync_weights(iter([(n, t) for n, t in named if n != missing]), engine, bucket_mb=0.01)
    with pytest.raises(RuntimeError, match=missing.replace(".", r"\.")):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=0.0))
    sync_weights(iter([(n, t) for n, t in named if n == missing]), engine, bucket_mb=0.01)
    assert torch.equal(engine.probe_logits(ids), target.float())


def test_bucket_files_round_trip_in_order_and_leave_nothing_behind(tmp_path, monkeypatch):
    """engine.generation.sync.bucket_files: a bucket comes back bitwise in its order (tensors that
    share storage, views, non-contiguous and empty ones included) to every reader, and the
    file stays until its writer deletes it;
    without room in /dev/shm the file goes to the temporary directory, without room anywhere
    the write is refused naming rollout.sync_bucket_mb."""
    import shutil
    from collections import namedtuple

    from engine.generation.sync import bucket_files as bucket_files

    base = torch.randn(6, 4)
    bucket = [("z.weight", base), ("a.weight", base[:, :2].t()), ("tied.weight", base),
              ("m.bias", torch.arange(3, dtype=torch.bfloat16))]
    bucket.append(("empty.bias", torch.zeros(0)))
    path, names = bucket_files.write_bucket(bucket)
    assert names == ["z.weight", "a.weight", "tied.weight", "m.bias", "empty.bias"]
    # every worker of a TP > 1 engine reads the same file: the first read leaves it for the
    # second (a reader that deleted it failed the others), the writer deletes it after both
    readers = [bucket_files.read_bucket(path, names) for _ in range(2)]
    assert os.path.exists(path)
    bucket_files.discard(path)
    assert not os.path.exists(path)
    for back in readers:   # mapped views stay valid after the file is gone
        assert [n for n, _ in back] == names
        for (_, want), (_, got) in zip(bucket, back):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(bucket_files.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bucket_files.shutil, "disk_usage", lambda d: usage(1, 1, 0)
                        if d == bucket_files.SHARED_MEMORY else real(d))
    path, _ = bucket_files.write_bucket(bucket)
    assert os.path.dirname(path) == str(tmp_path)
    bucket_files.discard(path)
    assert not os.path.exists(path)
    monkeypatch.setattr(bucket_files.shutil, "disk_usage", lambda d: usage(1, 1, 0))
    with pytest.raises(OSError, match="rollout.sync_bucket_mb"):
        bucket_files.write_bucket(bucket)
