"""Single-GPU SFT through the real entry point: `torchrun --nproc_per_node 1 -m engine.sft`.

    python -m tools.bench.gpu_sft --workdir /tmp/gpu_sft                 # on a CUDA host
    python -m tools.bench.gpu_sft --workdir /tmp/gpu_sft --tiny          # CPU smoke (gloo)

Builds, locally (nothing is downloaded), random-weight HF models with the tests' word-level
chat tokenizer (tools/tiny_models.py) and a synthetic chat JSON-lines file of `--rows` rows
whose assistant turns are longer than `--seq`, so every sequence is cut to exactly `--seq`
tokens (data.truncation=right). The same rows repeat every epoch: the loss must fall.

Cases (each a separate launch, bf16 on CUDA):
  dense      Qwen3-0.6B widths (28 layers, hidden 1024, 16 heads / 8 KV heads, head_dim 128,
             FFN 3072, vocab 151936, tied embeddings), no recomputation
  selective  dense with train.recompute=selective
  full       dense with train.recompute=full (uniform, 1 layer)
  moe        Qwen3-MoE: 16 layers, hidden 1024, 16 experts top-2 (moe_intermediate 768),
             untied embeddings; parallel.ep=1, moe.token_dispatcher=alltoall
  unfused    dense with every model.fusions.* off (the default since 2026-11-24; = dense)
  fused      dense with every model.fusions.* on (swiglu, residual, rmsnorm; rmsnorm needs CUDA)
  moe_fused  moe with every model.fusions.* on
  moe_loop   moe with moe.grouped_experts=false (megatron's SequentialMLP, one GEMM per expert)
  fuse_X     dense with only model.fusions.X on (X: swiglu, residual, rmsnorm)
  lora       dense with LoRA rank 16 on every linear layer (model.lora.rank=16, alpha 32)
  unchunked  dense with train.loss_chunk_tokens=0 (megatron's whole [tokens, vocab] logits)
  eager      dense with train.compile=false (no compiled regions: the ladder item, docs/benchmarks.md)
  foreach    dense with optim.fused=false (torch's foreach AdamW instead of its fused kernel)
  muon       dense with optim.name=muon (megatron-core's Muon for the layers' matrices, AdamW for
             the rest; bf16 Newton-Schulz, its default; the layer-wise distributed optimizer,
             one rank: no sharding); needs emerging-optimizers (docs/optimizers.md)
  mtp_off    glm: a GLM-4.5-shaped MoE (glm4_moe; the moe case's sizes where they apply: 16
             layers, hidden 1024, the first dense (FFN 3072), 16 routed experts top-2 of width
             768 plus one shared expert, n_group 1) with a complete random MTP layer
             (tools.tiny_models.append_full_mtp_layer), carried through untrained
  mtp_on     mtp_off with model.mtp.enabled=true (the MTP layer trained, loss_scale 0.1)

`--vocab N` builds the dense model with that vocabulary (its folder is model_dense_vN), for the
loss-head comparison at long sequences (`--seq 32768 --gbs 1 --cases dense,unchunked`).

Reported per case (steps after `--warmup`): median step time, tokens/s, model TFLOP/s and MFU
against the GPU's dense bf16 peak (tools/bench/mfu.py's table), peak allocated GPU memory
(the engine's memory/max_allocated_gib metric), first/last loss. Model FLOPs per step =
3 x forward; forward = 2 x (weights used per token, LM head included, embedding lookup not) x
tokens + causal attention 2 x 2 x q_dim x L(L+1)/2 per layer and sequence (mfu.py's
count; tools/bench/model_flops.py); for MoE the weights used per token are the attention, the
router and top-k experts.
Recomputation is not counted (MFU, not hardware FLOP utilisation). With `--profile-step N` the
N-th step of each case runs under torch.profiler (tools/bench/gpu/step_profile.py: the share of
the step the GPU is busy, kernels and host syncs per step; pick a warm-up step so the profiler's
overhead stays out of the median). GLM: the first
`first_k_dense_replace` layers are dense, the others count top-k routed + shared experts; with
model.mtp.enabled the MTP layer's FLOPs are counted too (one more MoE layer with its attention,
eh_proj [2h -> h] and a second pass of the output head); a case with MTP also reports the
engine's mtp/loss and mtp/accuracy (first and last step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # also `python tools/bench/gpu_sft.py`

from tools.bench.model_flops import model_flops, param_counts  # noqa: E402

DENSE = dict(arch="qwen3", vocab_size=151936, hidden=1024, layers=28, heads=16, kv_heads=8,
             intermediate=3072, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0)
MOE = dict(arch="qwen3_moe", vocab_size=151936, hidden=1024, layers=16, heads=16, kv_heads=8,
           intermediate=3072, head_dim=128, num_experts=16, num_experts_per_tok=2,
           moe_intermediate_size=768, max_position_embeddings=40960, rope_theta=1000000.0)
TINY_DENSE = dict(arch="qwen3", vocab_size=200, hidden=64, layers=2, heads=4, kv_heads=2,
                  intermediate=128, head_dim=16, max_position_embeddings=1024)
GLM = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=8, head_dim=128, intermediate_size=3072,
           moe_intermediate_size=768, n_routed_experts=16, num_experts_per_tok=2,
           max_position_embeddings=40960)
TINY_GLM = dict(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                max_position_embeddings=1024)
TINY_MOE = dict(arch="qwen3_moe", vocab_size=200, hidden=64, layers=2, heads=4, kv_heads=2,
                intermediate=128, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, max_position_embeddings=1024)

FUSIONS = ("swiglu", "residual", "rmsnorm")  # engine.config.fusion_settings.FUSIONS (no torch here)
CASES = {  # name -> (model key, extra engine.sft overrides)
    "dense": ("dense", []),
    "selective": ("dense", ["train.recompute=selective"]),
    "full": ("dense", ["train.recompute=full"]),
    "moe": ("moe", ["parallel.ep=1", "moe.token_dispatcher=alltoall"]),
    "unfused": ("dense", ["model.fusions.swiglu=false", "model.fusions.residual=false",
                          "model.fusions.rmsnorm=false"]),
    "moe_loop": ("moe", ["parallel.ep=1", "moe.token_dispatcher=alltoall",
                         "moe.grouped_experts=false"]),
    "fused": ("dense", [f"model.fusions.{f}=true" for f in FUSIONS]),
    "moe_fused": ("moe", ["parallel.ep=1", "moe.token_dispatcher=alltoall",
                          *(f"model.fusions.{f}=true" for f in FUSIONS)]),
    **{f"fuse_{only}": ("dense", [f"model.fusions.{f}={'true' if f == only else 'false'}"
                                  for f in FUSIONS])
       for only in FUSIONS},
    "lora": ("dense", ["model.lora.rank=16", "model.lora.alpha=32"]),
    "unchunked": ("dense", ["train.loss_chunk_tokens=0"]),
    "eager": ("dense", ["train.compile=false"]),
    "foreach": ("dense", ["optim.fused=false"]),
    "muon": ("dense", ["optim.name=muon"]),
    "mtp_off": ("glm", ["parallel.ep=1", "moe.token_dispatcher=alltoall"]),
    "mtp_on": ("glm", ["parallel.ep=1", "moe.token_dispatcher=alltoall",
                       "model.mtp.enabled=true"]),
}
MTP_ON = "model.mtp.enabled=true"


def build_glm(path: str, sizes: dict) -> str:
    """A random GLM-4.5-shaped MoE at `sizes` (GLM or TINY_GLM) with one shared expert,
    n_group 1, the first layer dense, one complete random MTP layer and the tiny tokenizer."""
    from transformers.models.glm4_moe import Glm4MoeConfig

    from tools.tiny_models import append_full_mtp_layer, build_tokenizer, save_random_model

    config = Glm4MoeConfig(**sizes, n_shared_experts=1, n_group=1, topk_group=1,
                           first_k_dense_replace=1, norm_topk_prob=True,
                           num_nextn_predict_layers=1, tie_word_embeddings=False,
                           eos_token_id=3, pad_token_id=0)
    config.architectures = ["Glm4MoeForCausalLM"]
    save_random_model(path, config, 0)
    append_full_mtp_layer(path, config, 0)
    build_tokenizer(path, sizes["vocab_size"])
    return path


def build_models(workdir: Path, tiny: bool, needed: set[str],
                 vocab: int | None = None) -> dict[str, str]:
    from tools.tiny_models import build_tiny_model

    specs = {"dense": dict(TINY_DENSE if tiny else DENSE), "moe": TINY_MOE if tiny else MOE}
    if vocab:
        specs["dense"]["vocab_size"] = vocab
    out = {}
    for key in sorted(needed):
        path = workdir / (f"model_{key}_v{vocab}" if vocab and key == "dense" else f"model_{key}")
        if not (path / "config.json").exists():
            t0 = time.perf_counter()
            if key == "glm":
                build_glm(str(path), TINY_GLM if tiny else GLM)
            else:
                spec = dict(specs[key])
                build_tiny_model(str(path), spec.pop("arch"), **spec)
            print(f"[bench] built {key} model in {time.perf_counter() - t0:.1f} s", flush=True)
        out[key] = str(path)
    return out


def write_data(path: Path, rows: int, seq: int, seed: int = 0) -> None:
    """Chat rows: a short user turn, an assistant turn of > seq tokens that repeats a
    row-specific 61-token phrase (learnable, so the loss falls; the tiny tokenizer reads
    letters, digits and punctuation as one token each)."""
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789+-*/=?.,:;!()")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            phrase = " ".join(rng.choice(alphabet) for _ in range(61))
            user = " ".join(rng.choice(alphabet) for _ in range(32))
            answer = " ".join([phrase] * (seq // 61 + 2))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}) + "\n")


def run_case(name: str, model_dir: str, data: Path, workdir: Path, args) -> dict:
    model_key, extra = CASES[name]
    log_dir = workdir / "runs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = log_dir / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    profile_path = log_dir / "profile.json"
    if profile_path.exists():
        profile_path.unlink()
    entry = (["tools.bench.gpu.step_profile", str(profile_path), str(args.profile_step),
              "engine.sft"] if args.profile_step else ["engine.sft"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(args.port), "-m", *entry,
           f"model.hf_path={model_dir}", f"model.dtype={args.dtype}",
           f"data.train_files=[{data}]", f"data.cache_dir={workdir / 'cache'}",
           "data.num_workers=1", f"train.seq_length={args.seq}",
           f"train.global_batch_size={args.gbs}", "train.micro_batch_size=1",
           f"train.max_steps={args.steps}", f"optim.lr={args.lr}", "optim.warmup_steps=2",
           "optim.schedule=constant", f"logging.dir={log_dir}", "logging.progress_bar=false",
           *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    with open(log_dir / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(metrics_path)] if metrics_path.exists() else []
    res = {"case": name, "rc": rc, "wall_s": wall, "steps": len(rows), "cmd": cmd}
    if rc != 0 or not rows:
        res["log_tail"] = open(log_dir / "log.txt").read()[-4000:]
        return res
    hf = json.load(open(Path(model_dir) / "config.json"))
    timed = rows[args.warmup:] or rows
    step_s = statistics.median(r["time/step_s"] for r in timed)
    tokens = statistics.median(r["num_tokens"] for r in timed)
    nseq = timed[0]["num_sequences"]
    lengths = [tokens / nseq] * int(nseq)  # every row is longer than seq_length: all cut equal
    mtp = 1 if MTP_ON in extra else 0
    flops = model_flops(hf, lengths, mtp)
    losses = [r["loss"] for r in rows]
    total, active = param_counts(hf, mtp)
    if profile_path.exists():  # --profile-step: tools.bench.gpu.step_profile's summary
        res["profile"] = json.loads(profile_path.read_text())
    for key in ("mtp/loss", "mtp/accuracy"):
        if key in rows[0]:
            res[key.replace("/", "_")] = [rows[0][key], rows[-1][key]]  # first, last step
    res.update(
        step_s=step_s, step_s_all=[r["time/step_s"] for r in rows], tokens_per_step=tokens,
        tokens_per_s=tokens / step_s, tflops=flops / step_s / 1e12, params=total,
        active_params=active, seq_len_mean=tokens / nseq, losses=losses,
        grad_norms=[r["grad_norm"] for r in rows],
        finite=all(math.isfinite(x) for x in losses + [r["grad_norm"] for r in rows]),
        decreased=losses[-1] < losses[0],
        peak_mem_gib=max((r.get("memory/max_allocated_gib", 0.0) for r in rows), default=None),
        skipped=rows[-1].get("train/skipped_steps"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/bench_gpu_sft")
    ap.add_argument("--cases", default="dense,moe,full,selective")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke test)")
    ap.add_argument("--vocab", type=int, default=None, help="the dense model's vocabulary")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile-step", type=int, default=0,
                    help="profile this 1-based step of every case (tools.bench.gpu."
                         "step_profile: GPU busy fraction, kernels, host syncs); 0: none")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: {unknown} unknown; valid: {sorted(CASES)}")
    models = build_models(workdir, args.tiny, {CASES[c][0] for c in cases}, args.vocab)
    data = workdir / f"data_{args.seq}.jsonl"
    write_data(data, args.rows, args.seq)
    from tools.bench.mfu import peak_bf16_tflops

    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_bf16_tflops(gpu) if cuda else None
    results = []
    for c in cases:
        res = run_case(c, models[CASES[c][0]], data, workdir, args)
        res["mfu"] = res["tflops"] / peak if peak and "tflops" in res else None
        results.append(res)
        brief = {k: res.get(k) for k in ("case", "rc", "wall_s", "step_s", "tokens_per_s",
                                           "tflops", "mfu", "peak_mem_gib", "finite",
                                           "decreased", "mtp_loss", "mtp_accuracy",
                                           "profile")}
        print("[bench] " + json.dumps(brief), flush=True)
        if "log_tail" in res:
            print(res["log_tail"], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": gpu, "peak_bf16_tflops": peak, "args": vars(args),
                           "torch": torch.__version__, "results": results}, f, indent=1)
    print(f"\nGPU: {gpu}; dtype {args.dtype}; seq {args.seq}; global batch {args.gbs} "
          f"(micro-batch 1); {args.steps} steps, median over steps {args.warmup + 1}.."
          f"{args.steps}\n")
    print("| case | params (active) | step s | tokens/s/GPU | TFLOP/s | MFU | peak GiB | "
          "loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "step_s" not in r:
            print(f"| {r['case']} | failed rc={r['rc']} | | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"| {r['case']} | {r['params'] / 1e9:.2f}B ({r['active_params'] / 1e9:.2f}B) | "
              f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | "
              f"{r['peak_mem_gib']:.1f} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    for r in results:
        if r.get("mtp_loss"):
            acc = r.get("mtp_accuracy") or [math.nan, math.nan]
            print(f"\n{r['case']}: mtp/loss {r['mtp_loss'][0]:.3f} -> {r['mtp_loss'][1]:.3f}, "
                  f"mtp/accuracy {acc[0]:.3f} -> {acc[1]:.3f} (MFU counts the MTP layer)")
    for r in results:
        if r.get("profile"):
            p, busy = r["profile"], r["profile"].get("gpu_busy")
            print(f"\n{r['case']}: step {p['call']} profiled: {p['wall_ms']:.0f} ms, GPU busy "
                  f"{'n/a' if busy is None else f'{busy:.1%}'}, {p['kernels']} kernels, "
                  f"{p['host_syncs']} host syncs {p['sync_calls']}")  # None: not traced
    return 0 if all(r["rc"] == 0 and r.get("finite") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
