"""Speculative decoding in vLLM rollouts (rollout.vllm.speculative): rollout tokens/s of the
same prompts, weights and sampling with and without speculation, side by side in one process
(one engine at a time), with the draft's acceptance (docs/rollout-backends.md).

    python -m tools.bench spec --model-dir DIR [--method mtp] [--num-tokens 2]
                               [--prompts 64] [--max-new 256] [--repeats 1]
                               [--prompts-file RL_PROMPTS.jsonl]
    python -m tools.bench spec --quick     a tiny random GLM-4.5 MoE with a random MTP layer
                                           (a smoke run: a random head accepts ~nothing)

DIR: an HF folder whose config.json declares MTP layers (method mtp; a GLM-4.5 / DeepSeek-V3 /
Qwen3.5 checkpoint, or one whose MTP head was trained by `python -m engine.sft` with
model.mtp.enabled), or any folder with --method draft_model --draft-path DRAFT. Prompts: random
token ids of 32-96 tokens (seeded), or with --prompts-file the first --prompts rows of an RL
prompt file rendered with the model's chat template, temperature 1, one seed per response as the RL loop sends
them, fp32 on CPU (model dtype on GPUs). Each engine is built, warmed up with one short call,
then timed over `repeats` full calls (median); tokens/s = generated tokens / wall seconds of
the call (engine start not counted, reported apart). Reported: tokens/s both ways, the
speedup, acceptance (accepted / proposed draft tokens), accepted draft tokens per drafting
step, and whether greedy ids agree both ways on the first prompts (they must). CPU speedups are
not GPU speedups: the acceptance and the exactness carry over.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time

from tools.bench.common import BenchResult, Table, fmt, median
from tools.tiny_models import tiny_mtp_model

PROMPTS, MAX_NEW, REPEATS = 64, 256, 1
QUICK = (8, 32, 1)
GREEDY_CHECK = (4, 16)   # prompts, new tokens of the greedy comparison


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(32, 96))] for _ in range(count)]


def _file_prompts(path: str, model_dir: str, count: int) -> list[list[int]]:
    """The first `count` prompts of an RL prompt file ({"prompt": text} rows), each rendered
    as one user turn with the model's chat template and the assistant's generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:count]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for r in rows]


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def _engine(model_dir: str, spec, max_len: int):
    import torch

    from engine.config.rollout_settings import VLLMConfig
    from engine.generation.vllm.backend import VLLMRolloutEngine
    from engine.generation.vllm.settings import engine_args

    on_cpu = not torch.cuda.is_available()
    kwargs = engine_args(VLLMConfig(max_model_len=max_len, speculative=spec), 1, on_cpu)
    return VLLMRolloutEngine(model_dir, dtype=torch.float32 if on_cpu else "auto", seed=0,
                             off_switch=(None, 1), **kwargs)


def _measure(model_dir: str, spec, prompts, max_new: int, repeats: int) -> dict:
    """One engine (`spec`: SpeculativeConfig, method None: plain): load seconds, median
    tokens/s, its spec counters over the timed calls, greedy ids of the check."""
    from engine.generation import SamplingParams

    start = time.perf_counter()
    engine = _engine(model_dir, spec, 96 + max_new + 8)
    load = time.perf_counter() - start
    try:
        count, new = GREEDY_CHECK
        greedy = [g.response_ids for g in engine.generate(
            prompts[:count], SamplingParams(max_new_tokens=new, temperature=0.0))]
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                seeds=list(range(len(prompts))))
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0,
                                                    seeds=[0, 1]))
        engine.speculation_counters()
        rates, tokens = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            made = sum(len(g.response_ids) for g in engine.generate(prompts, params))
            rates.append(made / (time.perf_counter() - t0))
            tokens += made
        return {"load_s": load, "tokens_per_s": median(rates), "tokens": tokens,
                "counters": engine.speculation_counters(), "greedy": greedy}
    finally:
        engine.shutdown()


def run_spec(quick: bool, model_dir: str | None = None, method: str = "mtp",
             num_tokens: int = 2, draft_path: str | None = None, prompts: int | None = None,
             max_new: int | None = None, repeats: int | None = None,
             prompts_file: str | None = None) -> BenchResult:
    from engine.config.rollout_settings import SpeculativeConfig
    from engine.generation.vllm.speculative import spec_metrics

    count, new, reps = QUICK if quick else (PROMPTS, MAX_NEW, REPEATS)
    count, new, reps = prompts or count, max_new or new, repeats or reps
    model = model_dir   # what the report names: never the temporary folder it deletes
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            if not quick:
                raise ValueError("tools.bench spec needs --model-dir (or --quick: a tiny "
                                 "random model)")
            model_dir = tiny_mtp_model(os.path.join(tmp, "glm"))
            model = "a tiny random GLM-4.5 MoE with an MTP layer (--quick; built in a " \
                    "temporary folder, deleted after the run)"
        ids = (_file_prompts(prompts_file, model_dir, count) if prompts_file
               else _prompts(count, _vocab(model_dir)))
        plain = _measure(model_dir, SpeculativeConfig(), ids, new, reps)
        spec = _measure(model_dir, SpeculativeConfig(method=method, num_tokens=num_tokens,
                                                     draft_path=draft_path), ids, new, reps)
    m = spec_metrics([spec["counters"]], 1)
    speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
    table = Table(f"vLLM rollout with and without speculation ({method}, {num_tokens} draft "
                  f"tokens; {count} prompts x {new} new tokens, T = 1)",
                  ["engine", "load s", "tokens/s", "acceptance", "accepted per drafting step"],
                  [["plain", fmt(plain["load_s"]), fmt(plain["tokens_per_s"]), "", ""],
                   ["speculative", fmt(spec["load_s"]), fmt(spec["tokens_per_s"]),
                    fmt(m["rollout/spec_acceptance"]),
                    fmt(m["rollout/spec_mean_accepted_tokens"])]],
                  [f"speedup {speedup:.3f}x; greedy ids equal both ways: "
                   f"{plain['greedy'] == spec['greedy']}; model: {model}"])
    return BenchResult([table], {
        "spec_speedup": speedup, "spec_acceptance": m["rollout/spec_acceptance"],
        "spec_mean_accepted_tokens": m["rollout/spec_mean_accepted_tokens"],
        "plain_tokens_per_s": plain["tokens_per_s"], "spec_tokens_per_s": spec["tokens_per_s"],
        "spec_greedy_ids_equal": plain["greedy"] == spec["greedy"]})
