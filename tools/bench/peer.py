"""The transformers peer of gpu_sft's dense case: the same model and tokens, a plain torch loop.

    python -m tools.bench.peer --json OUT.json                 # on CUDA: Qwen3-0.6B widths
    python -m tools.bench.peer --tiny --modes eager --json F   # CPU check (tools' tiny widths)

What a user with transformers and torch.compile would write, measured on the same card in the
same `python -m tools.bench gpu` call as the engine (its item `peer`, right after `sft`):
  model      Qwen3ForCausalLM built from gpu_sft.DENSE's config (28 layers, hidden 1024, 16/8
             heads of 128, FFN 3072, vocabulary 151,936, tied embeddings; --tiny: TINY_DENSE),
             random init (seed 0), nothing downloaded; attn_implementation="sdpa"
  precision  --dtype bfloat16 (the default on CUDA): fp32 parameters, gradients and AdamW
             state, the forward and backward under torch.autocast(bfloat16). The engine's
             counterpart (gpu_sft, model.dtype=bfloat16) keeps bf16 weights for the matmuls
             and fp32 master weights, fp32 main_grad and Adam state in its distributed
             optimizer: both compute in bf16 and update in fp32. float32 (CPU default): no
             autocast.
  step       the gpu_sft dense case's tokens: --gbs sequences of --seq tokens (8 x 4,096),
             micro-batch 1, --gbs accumulation steps, each micro-batch's loss (transformers'
             own shifted token-mean cross-entropy, labels = input ids) divided by --gbs;
             clip_grad_norm_(1.0) (the engine's optim.clip_grad); torch.optim.AdamW(fused=True,
             lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0: the engine's defaults and
             gpu_sft's lr); set_to_none zero_grad. The token ids are random (seed 0), the same
             batch every step (the engine's rows repeat too; speed does not depend on them).
  modes      eager: the module as built; compiled: torch.compile(model) (default mode), each on
             a fresh model from the same seed, so both start from the same weights.
Timing: `--warmup` steps (compilation happens there), then `--steps` timed steps, each ended by
a device synchronize; the median is reported. With --profile one more step runs under
torch.profiler (tools/bench/gpu/step_profile.py: GPU busy share, kernels, host syncs).
FLOPs and MFU: gpu_sft.model_flops (the engine cases' own count) over --gbs sequences of --seq
tokens, against tools/bench/mfu.py's dense bf16 peak.

Output (--json): {gpu, peak_bf16_tflops, torch, transformers, args, results: [{mode, step_s,
step_s_all, tokens_per_step, tokens_per_s, tflops, mfu, peak_mem_gib, losses, finite,
decreased, compile_s (first step's seconds), profile}]}; the last stdout line is that object's
summary.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # also `python tools/bench/peer.py`

from tools.bench.gpu_sft import DENSE, TINY_DENSE  # noqa: E402
from tools.bench.model_flops import model_flops  # noqa: E402

MODES = ("eager", "compiled")
LR, BETAS, EPS, CLIP = 3e-4, (0.9, 0.95), 1e-8, 1.0


def peer_config(tiny: bool):
    """The Qwen3Config of gpu_sft's dense model (tools.tiny_models.build_tiny_model's fields
    for gpu_sft.DENSE, or TINY_DENSE with `tiny`), SDPA attention."""
    from transformers import AutoConfig

    from tools.tiny_models import ARCH_DEFAULTS

    spec = dict(TINY_DENSE if tiny else DENSE)
    cfg = dict(ARCH_DEFAULTS[spec.pop("arch")])
    model_type = cfg.pop("model_type")
    cfg.update(vocab_size=spec.pop("vocab_size"), hidden_size=spec.pop("hidden"),
               num_hidden_layers=spec.pop("layers"), num_attention_heads=spec.pop("heads"),
               num_key_value_heads=spec.pop("kv_heads"),
               intermediate_size=spec.pop("intermediate"), max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, eos_token_id=3,
               bos_token_id=None)
    cfg.update(spec)  # head_dim, max_position_embeddings, rope_theta of DENSE
    return AutoConfig.for_model(model_type, **cfg)


def build_model(config, device, seed: int = 0):
    """Qwen3ForCausalLM(config) in fp32 on `device`, transformers' own random init after
    torch.manual_seed(seed), in train mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.train()


def make_batch(vocab: int, seq: int, sequences: int, device, seed: int = 0):
    """[sequences, 1, seq] random token ids in [4, vocab) (ids below 4: the tokenizer's
    specials), one micro-batch of one sequence per row."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (sequences, 1, seq), generator=gen).to(device)


def make_optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=0.0, fused=True)


def train_step(model, optimizer, batch, autocast_dtype):
    """One optimizer step over the micro-batches of `batch` (module docstring); the mean
    micro-batch loss as a 0-dim tensor (no host sync here)."""
    import torch

    device_type = batch.device.type
    total = torch.zeros((), device=batch.device)
    for ids in batch:
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss / len(batch)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def reference_loss(model, batch) -> float:
    """The mean over micro-batches of the token-mean next-token cross-entropy, written out:
    fp32 log-softmax of the logits at positions 0..L-2 read at the ids of 1..L-1."""
    import torch

    with torch.no_grad():
        losses = []
        for ids in batch:
            logits = model(input_ids=ids).logits.float()[:, :-1]
            logp = torch.log_softmax(logits, dim=-1)
            losses.append(-logp.gather(-1, ids[:, 1:, None]).mean())
        return float(torch.stack(losses).mean())


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(mode: str, config, batch, steps: int, warmup: int, autocast_dtype,
             profile: bool = False) -> dict:
    """`warmup` + `steps` steps of one mode on a fresh model (seed 0); per-step seconds and
    losses, peak memory, and with `profile` one more profiled step."""
    import torch

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; valid: {', '.join(MODES)}")
    device = batch.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(config, device)
    optimizer = make_optimizer(model)
    run = torch.compile(model) if mode == "compiled" else model
    times, losses = [], []
    for _ in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        loss = train_step(run, optimizer, batch, autocast_dtype)
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    res = {"mode": mode, "step_s_all": times, "losses": losses, "compile_s": times[0]}
    if profile:
        from tools.bench.gpu.step_profile import profile_call

        loss, res["profile"] = profile_call(lambda: train_step(run, optimizer, batch,
                                                               autocast_dtype))
        losses.append(float(loss))
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del run, model, optimizer
    return res


def summarize(res: dict, config, seq: int, sequences: int, warmup: int,
              peak_tflops: float | None) -> dict:
    """Median step seconds over the timed steps, tokens/s, TFLOP/s, MFU, finite, decreased."""
    timed = res["step_s_all"][warmup:] or res["step_s_all"]
    step_s = statistics.median(timed)
    tokens = seq * sequences
    tflops = model_flops(config.to_dict(), [seq] * sequences) / step_s / 1e12
    losses = res["losses"]
    return {**res, "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "tflops": tflops, "mfu": tflops / peak_tflops if peak_tflops else None,
            "finite": all(math.isfinite(x) for x in losses), "decreased": losses[-1] < losses[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.peer",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: eager,compiled")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gbs", type=int, default=8, help="sequences (micro-batches) per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="bfloat16: fp32 params + bf16 autocast (default on CUDA); float32 "
                         "(default elsewhere): no autocast")
    ap.add_argument("--tiny", action="store_true", help="gpu_sft's tiny dense widths")
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: {bad} unknown; valid: {', '.join(MODES)}")
    import torch
    import transformers

    from tools.bench.mfu import peak_bf16_tflops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_bf16_tflops(gpu) if cuda else None
    config = peer_config(args.tiny)
    batch = make_batch(config.vocab_size, args.seq, args.gbs, device)
    results = []
    for mode in modes:
        t0 = time.perf_counter()
        res = summarize(run_mode(mode, config, batch, args.steps, args.warmup, autocast_dtype,
                                 args.profile), config, args.seq, args.gbs, args.warmup, peak)
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        brief = {k: res.get(k) for k in ("mode", "wall_s", "compile_s", "step_s",
                                         "tokens_per_s", "tflops", "mfu", "peak_mem_gib",
                                         "finite", "profile")}
        print("[peer] " + json.dumps(brief), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"gpu": gpu, "peak_bf16_tflops": peak, "torch": torch.__version__,
                 "transformers": transformers.__version__, "args": vars(args),
                 "results": results}, indent=1))
    print(json.dumps({r["mode"]: {"step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"],
                                  "mfu": r["mfu"]} for r in results}))
    return 0 if all(r["finite"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
