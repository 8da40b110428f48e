"""Logit parity of the HF <-> Megatron bridge across TP/PP layouts, in one torchrun launch.

  torchrun --nproc_per_node 4 tests/multirank/bridge_layouts.py \
      --model qwen3 HF_DIR CKPT_DIR [--model llama HF_DIR CKPT_DIR ...]

For every model and every layout of LAYOUTS (dp = 4 / (tp * pp)), inside the same processes:
re-initialise megatron parallel state, build this rank's chunks, fill them with NaN, load them
(source "hf": `models.bridge.weights.load_hf_weights`; source "ckpt": `models.bridge.checkpoint.load_model`
from CKPT_DIR, a TP1 checkpoint written by `tools/convert.py hf-to-mcore`), compute fp32 logits
with `models.build.forward.forward_logits` on fixed random tokens and compare them with transformers'
logits of HF_DIR computed on every rank. The difference is reduced with MAX over the whole
world, so every rank's copy of the logits is checked.

Rank 0 prints one JSON line per (arch, layout, source):
  {"arch": ..., "layout": "tp2pp1", "source": "hf"|"ckpt", "max_abs_diff": float,
   "ref_std": float[, "vs_hf_load": float]}
("vs_hf_load", on "ckpt" lines: max abs diff to the "hf"-loaded logits at the same layout), and
one line per arch comparing the checkpoint loaded at TP2 with the one loaded at PP2, both
computed with float64 parameters so that TP's different fp32 reduction order does not blur
the identity:
  {"arch": ..., "layout": "tp2pp1_vs_tp1pp2", "source": "ckpt_fp64", "max_abs_diff": float}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# name -> (tp, pp); dp is what remains of the 4 ranks. A name ending in "sp" runs with
# Megatron sequence parallelism on SEQ - 1 tokens (odd: forward_logits pads them to a multiple
# of tp) and is compared with the reference's first SEQ - 1 positions (causal attention).
LAYOUTS: dict[str, tuple[int, int]] = {
    "tp1pp1": (1, 1),
    "tp2pp1": (2, 1),
    "tp1pp2": (1, 2),
    "tp2pp2": (2, 2),
    "tp1pp4": (1, 4),
    "tp2pp2sp": (2, 2),
}
CROSS = ("tp2pp1", "tp1pp2")
BATCH, SEQ = 2, 16


def _nan_fill(chunks: list) -> None:
    """Poison every parameter so a weight the loader misses shows up as NaN logits."""
    import torch

    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.fill_(float("nan"))


def _world_max(value: float) -> float:
    """MAX of `value` over all ranks (NaN-propagating: NaN is sent as +inf)."""
    import math

    import torch
    import torch.distributed as dist

    t = torch.tensor([math.inf if math.isnan(value) else value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _reference_logits(hf_dir: str, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _megatron_logits(cfg: dict, tokens, reader, ckpt_dir: str, dtype, **overrides):
    """Full-vocab fp32 logits [b, s, vocab] of chunks built for the current layout with
    `params_dtype=dtype` (and TransformerConfig `overrides`), NaN-poisoned, then loaded from
    HF (`reader` given) or from `ckpt_dir`. Collective over the world."""
    from models.bridge.weights import load_hf_weights
    from models.bridge.checkpoint import load_model
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_logits

    chunks = build_model_chunks(cfg, params_dtype=dtype, **overrides)
    _nan_fill(chunks)
    if reader is not None:
        load_hf_weights(chunks, reader, cfg)
    else:
        load_model(chunks, ckpt_dir)
    return forward_logits(chunks, tokens, cfg["vocab_size"])


def run_arch(arch: str, hf_dir: str, ckpt_dir: str, rank: int) -> None:
    """All layouts x sources for one model; rank 0 prints the JSON lines."""
    import torch
    import torch.distributed as dist

    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    cfg = read_config(hf_dir)
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    tokens[0, -1] = vocab - 1  # the last real row, next to the padded ones
    ref = _reference_logits(hf_dir, tokens)
    reader = SafetensorsReader(hf_dir)
    for name, (tp, pp) in LAYOUTS.items():
        setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))
        sp = name.endswith("sp")
        width = SEQ - 1 if sp else SEQ
        by_source = {}
        for source in ("hf", "ckpt"):
            by_source[source] = _megatron_logits(cfg, tokens[:, :width],
                                                 reader if source == "hf" else None,
                                                 ckpt_dir, torch.float32, sequence_parallel=sp)
            diff = (by_source[source] - ref[:, :width]).abs().max().item()
            record = {"arch": arch, "layout": name, "source": source,
                      "max_abs_diff": _world_max(diff), "ref_std": ref.std().item()}
            if source == "ckpt":
                record["vs_hf_load"] = _world_max(
                    (by_source["ckpt"] - by_source["hf"]).abs().max().item())
            if rank == 0:
                print(json.dumps(record), flush=True)
    # TP changes the order of fp32 reductions (measured ~1e-5 at logit std 1.6), so the
    # resharding identity check runs in float64, where that noise is ~1e-14.
    kept = {}
    for name in CROSS:
        tp, pp = LAYOUTS[name]
        setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))
        kept[name] = _megatron_logits(cfg, tokens, None, ckpt_dir, torch.float64)
    cross = _world_max((kept[CROSS[0]] - kept[CROSS[1]]).abs().max().item())
    if rank == 0:
        print(json.dumps({"arch": arch, "layout": f"{CROSS[0]}_vs_{CROSS[1]}",
                          "source": "ckpt_fp64", "max_abs_diff": cross}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", nargs=3, action="append", required=True,
                        metavar=("ARCH", "HF_DIR", "CKPT_DIR"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from parallel.process_groups import init_distributed, shutdown

    rank, world = init_distributed()
    if world != 4:
        raise SystemExit(f"launch with 4 ranks (got {world})")
    for arch, hf_dir, ckpt_dir in args.model:
        run_arch(arch, hf_dir, ckpt_dir, rank)
    shutdown()
    return 0


if __name__ == "__main__":
    from engine.cli import exit_process

    exit_process(main())
