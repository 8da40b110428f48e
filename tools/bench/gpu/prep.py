"""Inputs of the checklist's items that the demos do not write.

    python -m tools.bench.gpu.prep lora-adapter BASE OUT [--scale 0.05] [--rank 8]
        a peft adapter on the HF causal LM at BASE: LoraConfig(r, lora_alpha=2r,
        target_modules="all-linear", init_lora_weights=False) (random A and B, seed 0), every
        lora_B multiplied by `scale` (0: a zero-B adapter, the identity), saved to OUT
    python -m tools.bench.gpu.prep vision-rows SRC DST [--image-rows 40] [--text-rows 12]
        the first `image-rows` rows of SRC (the counting demo's picture rows) with a text-only
        chat row ("how many squares ?" -> "1".."4") after each of the first `text-rows`
        of them, written to DST
    python -m tools.bench.gpu.prep glm-model WORKDIR
        tools/bench/gpu_sft.py's GPU-sized GLM-4.5 MoE with its MTP layer in WORKDIR/model_glm
        (built only when missing: the mtp item builds the same folder)
    python -m tools.bench.gpu.prep spec-json OUT [SPEC ARGS...]
        runs `python -m tools.bench spec SPEC ARGS...`, shows its output and writes its summary
        (the JSON object of its last stdout line) to OUT; exits with spec's status
    python -m tools.bench.gpu.prep bench-json OUT BENCH [ARGS...]
        the same for any `python -m tools.bench BENCH ARGS...` (the mfu item: BENCH mfu)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def build_lora_adapter(base: str, out: str, scale: float, rank: int = 8) -> int:
    """Save a small non-zero peft adapter for the model at `base` to `out` (see module
    docstring); returns its number of LoRA parameters."""
    import torch  # function-level: the module's other command needs neither torch nor peft
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules="all-linear",
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(out)
    return sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)


def text_row(i: int) -> dict:
    """The i-th text-only chat row (no image)."""
    return {"messages": [{"role": "user", "content": "how many squares ?"},
                         {"role": "assistant", "content": str(1 + i % 4)}]}


def interleave_text_rows(rows: list[dict], text_rows: int) -> list[dict]:
    """`rows` with text_row(i) after the i-th row for i < text_rows."""
    out = []
    for i, row in enumerate(rows):
        out.append(row)
        if i < text_rows:
            out.append(text_row(i))
    return out


def write_vision_rows(src: str, dst: str, image_rows: int, text_rows: int) -> int:
    """DST = the first `image_rows` rows of SRC interleaved with `text_rows` text-only rows;
    returns the number of rows written."""
    with open(src, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:image_rows]
    mixed = interleave_text_rows(rows, text_rows)
    Path(dst).write_text("".join(json.dumps(r) + "\n" for r in mixed), encoding="utf-8")
    return len(mixed)


def build_glm_model(workdir: str) -> str:
    """gpu_sft's GLM model folder under `workdir` (built when missing)."""
    from tools.bench.gpu_sft import build_models  # function-level: torch, transformers

    return build_models(Path(workdir), False, {"glm"})["glm"]


def spec_json(out: str, spec_args: list[str]) -> int:
    """Run tools.bench spec with `spec_args`, echo its stdout, save its last JSON line to
    `out` (only when it exits 0); its exit status."""
    return bench_json(out, "spec", spec_args)


def bench_json(out: str, bench: str, bench_args: list[str]) -> int:
    """Run `python -m tools.bench BENCH ARGS...`, echo its stdout, save its last JSON line to
    `out` (only when it exits 0; an `out` of an earlier call is removed first, so a failed run
    leaves none); its exit status."""
    from tools.bench.common import last_json_line  # function-level: only this command

    Path(out).unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "tools.bench", bench, *bench_args],
                          stdout=subprocess.PIPE, text=True)
    print(proc.stdout, flush=True)
    if proc.returncode == 0:
        Path(out).write_text(json.dumps(last_json_line(proc.stdout), indent=1))
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gpu.prep",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    adapter = sub.add_parser("lora-adapter")
    adapter.add_argument("base")
    adapter.add_argument("out")
    adapter.add_argument("--scale", type=float, default=0.05)
    adapter.add_argument("--rank", type=int, default=8)
    vision = sub.add_parser("vision-rows")
    vision.add_argument("src")
    vision.add_argument("dst")
    vision.add_argument("--image-rows", type=int, default=40)
    vision.add_argument("--text-rows", type=int, default=12)
    glm = sub.add_parser("glm-model")
    glm.add_argument("workdir")
    spec = sub.add_parser("spec-json")
    spec.add_argument("out")
    spec.add_argument("spec_args", nargs=argparse.REMAINDER)
    anybench = sub.add_parser("bench-json")
    anybench.add_argument("out")
    anybench.add_argument("bench")
    anybench.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "glm-model":
        print(f"model {build_glm_model(args.workdir)}")
        return 0
    if args.command == "spec-json":
        return spec_json(args.out, args.spec_args)
    if args.command == "bench-json":
        return bench_json(args.out, args.bench, args.bench_args)
    if args.command == "lora-adapter":
        count = build_lora_adapter(args.base, args.out, args.scale, args.rank)
        print(f"adapter {args.out}: {count} LoRA parameters, B scaled by {args.scale}")
    else:
        count = write_vision_rows(args.src, args.dst, args.image_rows, args.text_rows)
        print(f"rows {args.dst}: {count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
