"""Shared by the vLLM test files (rollout.backend=vllm, run for real): tests/test_vllm.py (the
engine-level tests), tests/test_vllm_lora_grpo.py and tests/test_vllm_rl.py (the `engine.rl`
runs). TINY: the tiny Qwen3 every file's `qwen3_dir` module fixture builds (32-dim heads: vLLM's
CPU attention refuses smaller ones). For the runs: `grpo_keys` (the overrides of a 2-step
`engine.rl` run on the vLLM backend), `grpo` (that run on the session's rank pool), `metrics`
(a run's metrics.jsonl rows) and `file_bytes` (what a sync of a folder's tensors sends). Helpers
one file uses stay in that file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, head_dim=32,
            initializer_range=0.2)


def grpo_keys(model_dir: str, prompts, out, *extra) -> list[str]:
    """The overrides of a 2-step `engine.rl` run with rollout.backend=vllm (`extra` replaces
    the defaults of the same key)."""
    keys = dict(a.split("=", 1) for a in (
        f"model.hf_path={model_dir}", f"data.train_files=[{prompts}]", "rollout.backend=vllm",
        "reward.fn=tests.test_rl_loop:digit_reward", "rollout.n=2", "rollout.max_new_tokens=6",
        "train.prompts_per_step=2", "train.micro_batch_size=1", "train.max_steps=2",
        "train.seq_length=48", "optim.lr=1e-2", "kl.beta=0.05", "train.mini_batches_per_step=2",
        f"data.cache_dir={out}/cache", "data.num_workers=0", f"logging.dir={out}/run",
        "logging.progress_bar=false", *extra))
    return [f"{k}={v}" for k, v in keys.items()]


def metrics(out) -> list[dict]:
    with open(f"{out}/run/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def grpo(pools, nproc: int, model_dir: str, prompts, out, *extra, **pool_kw) -> list[dict]:
    """`grpo_keys`'s run on the `nproc`-rank pool (`pool_kw` goes to pools.script); its
    metrics.jsonl rows."""
    proc = pools.script(nproc, "-m", "engine.rl", *grpo_keys(model_dir, prompts, out, *extra),
                        timeout=500, **pool_kw)
    assert proc.returncode == 0
    return metrics(out)


def file_bytes(folder, dtype: torch.dtype | None = None) -> float:
    """Bytes of the tensors of the folder's safetensors file (each in `dtype`; None: as
    stored)."""
    from safetensors.torch import load_file
    name = "adapter_model" if Path(f"{folder}/adapter_model.safetensors").exists() else "model"
    return float(sum(t.numel() * (t.element_size() if dtype is None else dtype.itemsize)
                     for t in load_file(f"{folder}/{name}.safetensors").values()))
