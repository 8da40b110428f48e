"""Checkpoint conversion between Hugging Face and Megatron-Core distributed checkpoints:
`megatron-sft-engine convert` (or `python tools/convert.py` in a checkout). Its --help prints
COMMANDS with the command as it was started (`help_text`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# what the commands share (tools/convert_verify.py too): one module both import, no circle
from tools.convert_common import fail, resolve_checkpoint, setup_layout  # noqa: E402

COMMANDS = """\
  {run} hf-to-mcore --hf-dir H --out C
  {run} hf-to-mcore --hf-dir H --adapter A --out C   (LoRA: base + PEFT adapter)
      (H may be a reward model: *ForSequenceClassification, num_labels 1, score.weight only)
  {run} mcore-to-hf --ckpt C --out O        (C may be a training iter_* dir
      or its parent run directory)
      [--iteration N]             (a run directory: this iteration; default the newest
                                   complete one, named in the output)
      [--overwrite]               (replace a non-empty --out: its contents are removed first)
      [--quantize fp8]            (an FP8 source: re-quantize with its scales; default bf16)
      [--merge] [--base H]        (LoRA checkpoints: a PEFT adapter, or the merged model)
      A PPO critic (checkpoint.dir/critic) exports as *ForTokenClassification; a reward model
      (its own config.json a one-label *ForSequenceClassification: hf-to-mcore of one, or an RM run)
      as *ForSequenceClassification, and with LoRA as a peft SEQ_CLS adapter (the score head
      in modules_to_save) or with --merge the merged classifier (tools/convert_reward.py)
  {verify} verify --hf-dir H --ckpt C --tp T --pp P
      [--ep E]                    (MoE: experts split over E ranks; E divides D = dp)
      (a reward model: its last-token scores against transformers' sequence classifier)
"""
DIRECT = "convert.py"   # main's prog when run as `python tools/convert.py`


def help_text(prog: str) -> str:
    """The description --help prints: COMMANDS as `prog` runs them (the console command
    `megatron-sft-engine convert`, whose --nproc-per-node starts torchrun's ranks; else the
    script, `verify` under torchrun)."""
    if prog == DIRECT:
        run, verify = "python tools/convert.py", "torchrun --nproc_per_node T*P*D tools/convert.py"
    else:
        run, verify = prog, f"{prog} --nproc-per-node T*P*D"
    return ("Checkpoint conversion between Hugging Face and Megatron-Core distributed "
            "checkpoints.\n\n" + COMMANDS.format(run=run, verify=verify))


ITERATION_HELP = ("--ckpt is a run's checkpoint directory: convert this iteration (default: "
                  "the newest complete one, which is printed)")
# Imports live in the commands: `--help` and argument errors answer without loading megatron.


def _claim_out(out: Path, overwrite: bool, ckpt: Path, meta: Path) -> None:
    """mcore-to-hf's --out: refuse a non-empty folder unless --overwrite, which empties it
    first (a stale shard or index left beside the new files would be loaded with them); never
    the checkpoint itself, a folder holding it or its own folder `meta` (hf_source/, or an
    older checkpoint's hf/; a newer checkpoint's hf/ is checkpoint.save_hf's export)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        fail(f"--out {out} exists and is not empty; pass --overwrite to replace it (its "
             "contents are removed first)")
    src, dst = ckpt.resolve(), out.resolve()
    if src == dst or dst in src.parents:
        fail(f"--out {out} holds the checkpoint {ckpt}; --overwrite would delete it")
    if dst == meta.resolve():
        fail(f"--out {out} is the checkpoint's own folder (its config, tokenizer and pass-through "
             "tensors); --overwrite would delete it")
    import shutil
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def hf_to_mcore(args) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from models.bridge.weights import check_tensors, load_hf_weights
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.build.factory import build_model_chunks
    from models.hf.config import check_config
    from models.hf.io import SafetensorsReader, read_config

    from tools.convert_reward import (is_sequence_classifier, reward_folder_problem,
                                      reward_to_mcore, trunk_reader)

    cfg = read_config(args.hf_dir)
    check_config(cfg)
    reader = SafetensorsReader(args.hf_dir)
    reward = is_sequence_classifier(cfg)  # a reward model: its trunk maps, its head is ours
    if reward and (problem := reward_folder_problem(args.hf_dir, cfg, reader,
                                                    getattr(args, "adapter", None))):
        fail(problem)
    check_tensors(cfg, trunk_reader(reader, cfg).keys() if reward else reader.keys())
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        fail(f"--out {out} exists and is not empty")
    setup_layout(cfg, args.tp, args.pp, args.ep)
    if reward:
        reward_to_mcore(cfg, args.hf_dir, out)
        if dist.get_rank() == 0:
            print(f"wrote Megatron distributed checkpoint of the reward model to {out}")
        return
    if getattr(args, "adapter", None):  # programmatic callers may leave the LoRA options out
        from tools.convert_lora import adapter_to_mcore
        adapter_to_mcore(cfg, args.hf_dir, args.adapter, out)
        if dist.get_rank() == 0:
            print(f"wrote Megatron LoRA checkpoint (adapters of {args.adapter}) to {out}")
        return
    chunks = build_model_chunks(cfg)
    total = sum(1 for c in chunks for _ in c.parameters())
    with tqdm(total=total, desc="hf-to-mcore", disable=dist.get_rank() != 0) as bar:
        load_hf_weights(chunks, reader, cfg, progress=bar.update)
    save_checkpoint(model_sharded_state_dict(chunks), out, cfg, args.hf_dir)
    if dist.get_rank() == 0:
        print(f"wrote Megatron distributed checkpoint to {out}")


def mcore_to_hf(args) -> None:
    from tqdm import tqdm

    from engine.checkpoint.hf_export import export_model_folder, write_hf
    from engine.rm.export import export_config, pad_problem
    from models.bridge.checkpoint import load_model, read_hf_config, source_dir
    from models.bridge.critic import is_critic_config
    from models.bridge.reward_model import is_reward_model_config
    from models.build.factory import build_model_chunks
    from models.layers.heads.value import attach_value_heads

    from tools.convert_lora import checkpoint_lora, export_lora
    from tools.convert_reward import export_reward_lora

    ckpt = resolve_checkpoint(args.ckpt, getattr(args, "iteration", None))
    out = Path(args.out)
    meta = source_dir(ckpt)  # its hf_source/, or an older checkpoint's hf/
    _claim_out(out, getattr(args, "overwrite", False), ckpt, meta)
    cfg = read_hf_config(ckpt)
    reward = is_reward_model_config(cfg)  # a reward model: its score head (no bias)
    if reward and (problem := pad_problem(cfg, meta)):  # before any work
        fail(f"--ckpt {ckpt}: {problem}")
    setup_layout(cfg)
    critic = is_critic_config(cfg)  # a PPO critic (checkpoint.dir/critic): its value head too
    # a critic is a full model, also when its config.yaml names the policy's LoRA adapters
    found = None if critic else checkpoint_lora(ckpt, getattr(args, "base", None), cfg)
    if found is None and getattr(args, "merge", False):
        fail(f"--merge needs a LoRA checkpoint; {ckpt} holds a full model")
    if found is not None:
        out.mkdir(parents=True, exist_ok=True)
        export_any = export_reward_lora if reward else export_lora
        n = export_any(ckpt, cfg, found, out, args.merge, args.dtype, lambda tensors: write_hf(
            tensors, export_config(cfg, meta) if reward else cfg, meta, out))
        what = "merged HF checkpoint" if args.merge else "PEFT adapter"
        print(f"wrote {what}{' of the reward model' if reward else ''} ({n} tensors) to {out}")
        if reward and args.merge:   # a folder transformers loads as it is
            _reward_calling_convention(out, meta)
        return
    chunks = build_model_chunks(cfg)
    if critic or reward:
        attach_value_heads(chunks, bias=critic)
    load_model(chunks, ckpt)
    out.mkdir(parents=True, exist_ok=True)
    cast = getattr(__import__("torch"), args.dtype) if args.dtype else None
    # the export checkpoint.save_hf writes during training too (engine.checkpoint.hf_export)
    n = export_model_folder(chunks, cfg, meta, out, cast, getattr(args, "quantize", None),
                            config_of=lambda c: export_config(c, meta) if reward else c,
                            progress=lambda s: tqdm(s, desc="mcore-to-hf"))
    print(f"wrote HF checkpoint ({n} tensors) to {out}")
    if reward:
        _reward_calling_convention(out, meta)


def _reward_calling_convention(out: Path, meta: Path) -> None:
    """A reward model's export: its scoring chat template and README.md (engine.rm.export, as
    a checkpoint.save_hf run writes them); `meta`: the checkpoint's own folder (its tokenizer)."""
    from engine.rm.export import write_scoring_files

    print(f"[convert] {write_scoring_files(out, meta)}; README.md: how to call it",
          flush=True)


def main(argv=None, prog: str = DIRECT) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=help_text(prog),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from engine.config.help import version
    parser.add_argument("--version", action="version", version=f"{prog} {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron distributed checkpoint")
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1, help="layout used while converting")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder of --hf-dir: "
                   "the checkpoint then holds the adapters (the base stays --hf-dir)")
    p = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors folder")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--iteration", type=int, default=None, help=ITERATION_HELP)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default=None, help="cast weights (e.g. bfloat16); default: as "
                   "stored")
    p.add_argument("--quantize", default=None, help="quantize the weights the HF source "
                   "stored quantized, with its recorded scales (fp8: block-scaled e4m3); "
                   "default: a checkpoint from a quantized source exports unquantized (bf16)")
    p.add_argument("--merge", action="store_true", help="LoRA checkpoints: write the merged HF "
                   "model (base + adapters) instead of a PEFT adapter")
    p.add_argument("--base", default=None, help="LoRA checkpoints: the base HF folder "
                   "(default: model.hf_path of the checkpoint's config.yaml / lora.json)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (its "
                   "contents are removed first); without it such an --out is refused")
    p = sub.add_parser("verify", help="logits parity of a checkpoint at a layout vs "
                       "transformers (a reward model: its sequence scores)")
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--iteration", type=int, default=None, help=ITERATION_HELP)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (MoE models): experts split over E ranks carved "
                        "out of the data-parallel ranks (E must divide world / (tp x pp))")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tolerance", type=float, default=None,
                   help="max abs logit difference allowed (default: 1e-4 in fp32; in bf16, "
                        "3e-2 x the largest |logit| of the reference, since both sides round "
                        "to bf16; a reward model's scores: 1e-4 x max(1, largest |score|) in "
                        "fp32)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from models.bridge.checkpoint import CheckpointError
    from models.hf.io import HFCheckpointError
    from models.families.base import UnsupportedModelError
    from parallel.layout import LayoutError
    try:
        if args.cmd == "hf-to-mcore":
            hf_to_mcore(args)
            rc = 0
        elif args.cmd == "mcore-to-hf":
            mcore_to_hf(args)
            rc = 0
        else:
            from tools.convert_verify import verify
            rc = verify(args)
    except (UnsupportedModelError, CheckpointError, HFCheckpointError, LayoutError,
            ValueError) as e:
        fail(str(e))
    from parallel.process_groups import shutdown
    shutdown()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine.cli import exit_process

    exit_process(main())
