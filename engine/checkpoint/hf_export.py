"""Hugging Face folders of a model held in memory: the one export that `tools/convert.py
mcore-to-hf` and `checkpoint.save_hf` share (docs/checkpoints.md#hugging-face-folders-during-training).

- `export_model_folder(chunks, cfg, meta_dir, out, ...)`: a full model as convert writes it:
  safetensors (models.bridge: the causal LM with its trained MTP layer, a PPO critic as
  *ForTokenClassification, a reward model's tensors), the pass-through tensors of `meta_dir`
  (a checkpoint's source folder `hf_source/`: models.bridge.checkpoint.source_dir,
  models.hf.passthrough), a quantized source's export rules
  (models.hf.quantized_export), config.json and the tokenizer files of `meta_dir`;
- `export_adapter_folder(chunks, cfg, spec, base, out, ...)`: a LoRA model's adapters as a
  peft adapter folder (models.lora.peft); a reward model's as peft's SEQ_CLS adapter, its
  trained score head (the last pipeline stage's) in modules_to_save;
- `save_hf_export(...)`: checkpoint.save_hf's step inside engine.checkpoint.checkpointing's
  save: the training chunks exported into `iter_NNNNNNN/hf/` before the checkpoint is marked
  complete (the checkpoint's own source files are in `iter_NNNNNNN/hf_source/`), with the
  run's `ExportExtras` (a reward model's config.json, chat template and README: engine.rm.export,
  handed down by its run; this package imports no objective).

Both exports are collective over the default process group. Every rank iterates its pipeline
stage's stream (TP and expert-parallel gathers inside: models.bridge.weights.export_hf_weights,
as RL's weight sync); the first data-parallel replica's TP rank 0 of each stage keeps the full
tensors in host memory; later stages hand theirs to global rank 0 through a file in `out` (the
checkpoint's file system is shared, as megatron's distributed checkpoint needs); rank 0 writes
the folder. With one pipeline stage (convert runs at world 1) there is no file and no barrier.
Tensor names are written in natural order (layer 2 before layer 10), so the folder does not
depend on the layout it was gathered from.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import load_file, save_file

from engine.checkpoint.io import STAGING_SUFFIX
from models.bridge.checkpoint import source_dir
from models.bridge.critic import SCORE_WEIGHT, export_critic, full_head_row, is_critic_config
from models.bridge.reward_model import export_reward_model, is_reward_model_config
from models.bridge.weights import export_hf_weights
from models.families.registry import family_of
from models.formats.quantized import quant_method
from models.hf.conditional import file_config, peft_layers, stored_names
from models.hf.io import copy_tokenizer_files
from models.hf.passthrough import read_passthrough
from models.hf.quantized_export import export_tensors
from models.layers.heads.value import value_head
from models.lora.peft import export_peft_tensors, write_peft_adapter
from models.lora.sites import ROUTER_PATH, lora_spec_of

HF_EXPORT_DIR = "hf"     # iter_NNNNNNN/hf/ (hf_source/ holds the checkpoint's own source files)
MAX_SHARD_BYTES = 5 * 1024 ** 3    # one safetensors file up to 5 GiB, then model-0000k-of-...
# the dtype convert's model holds (models.build.factory.build_model_chunks' default): a run
# training in bf16 exports its weights upcast to it, exactly as convert reads them back
CONVERT_DTYPE = torch.float32
# transformers' and peft's name of a reward model's head: the module a LoRA reward model's
# adapter folder saves in full (modules_to_save), beside the adapters
SCORE_MODULE = "score"
Stream = Iterable[tuple[str, torch.Tensor]]


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_safetensors(tensors: dict, out: Path) -> None:
    """`tensors` as `out/model.safetensors`, or in shards of at most MAX_SHARD_BYTES with
    model.safetensors.index.json, in natural name order."""
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_hf(tensors: dict, cfg: dict, meta_dir: Path, out: Path) -> None:
    """An HF folder: the tensors, config.json and the tokenizer files of `meta_dir` (a
    conditional-generation checkpoint's own names and config.json: models.hf.conditional)."""
    write_safetensors(stored_names(cfg, tensors), out)
    (out / "config.json").write_text(json.dumps(file_config(cfg), indent=2))
    copy_tokenizer_files(meta_dir, out)


def _on_host(stream: Stream, dtype: Optional[torch.dtype], held: Optional[torch.dtype]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as a host copy: floating ones first in `held` (the dtype convert's model
    holds; None: as given), then in `dtype` (None: kept)."""
    for name, tensor in stream:
        if held is not None and tensor.is_floating_point():
            tensor = tensor.to(held)
        yield name, tensor.to(device="cpu", dtype=dtype or tensor.dtype, copy=True)


def gather_stages(stream: Stream, out: Path) -> Optional[dict]:
    """Collective over the default group: consume this rank's `stream` (its pipeline stage's
    (name, host tensor) pairs; collective inside its stage) and return, on global rank 0, the
    tensors of every stage (None elsewhere). Stages after the first pass theirs through
    `out/.stage<k>.safetensors` (removed once read) around one barrier."""
    keep = (ps.get_data_parallel_rank(with_context_parallel=True) == 0
            and ps.get_tensor_model_parallel_rank() == 0)
    held = {}
    with torch.no_grad():
        for name, tensor in stream:
            if keep:
                held[name] = tensor
    stages, stage = ps.get_pipeline_model_parallel_world_size(), \
        ps.get_pipeline_model_parallel_rank()
    if stages > 1:
        if keep and stage > 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file(held, str(out / f".stage{stage}.safetensors"))
        dist.barrier()
        if dist.get_rank() == 0:
            for k in range(1, stages):
                part = out / f".stage{k}.safetensors"
                held.update(load_file(str(part)))
                part.unlink()
    return held if dist.get_rank() == 0 else None


def export_model_folder(chunks: list, cfg: dict, meta_dir: Path, out: Path,
                        dtype: Optional[torch.dtype] = None, quantize: Optional[str] = None,
                        held: Optional[torch.dtype] = None,
                        config_of: Callable[[dict], dict] = lambda c: c,
                        progress: Callable[[Stream], Stream] = lambda s: s) -> int:
    """Collective (module docstring): write the full model of `chunks` (HF config `cfg`) to
    `out` as convert mcore-to-hf does; returns the tensor count on rank 0 (0 elsewhere).
    `meta_dir`: the checkpoint's source folder (models.bridge.checkpoint.source_dir: tokenizer,
    pass-through tensors, quantized source);
    `dtype`: cast (convert's --dtype; not the weights a quantized source stored quantized);
    `quantize`: convert's --quantize; `held`: the dtype the weights are first brought to;
    `config_of`: the config.json written for the exported config (a reward model's: tools/
    convert_reward.export_config); `progress` wraps the stream (convert's progress bar)."""
    critic, reward = is_critic_config(cfg), is_reward_model_config(cfg)
    head = critic or reward
    quantized = quant_method(cfg) is not None and not head  # export_tensors casts then
    export = export_critic if critic else export_reward_model if reward else export_hf_weights
    stream = _on_host(progress(export(chunks, cfg)), None if quantized else dtype, held)
    tensors = gather_stages(stream, out)
    if tensors is None:
        return 0
    carried = read_passthrough(meta_dir)
    if head and carried:  # a classifier has no MTP layers: said, not dropped quietly
        print(f"[convert] left out {len(carried)} pass-through tensors of the causal LM (e.g. "
              f"{sorted(carried)[0]}): transformers' {cfg['architectures'][0]} has none")
        carried = {}
    tensors.update(carried)  # tensors carried unchanged (e.g. MTP layers): as read, never cast
    # a quantized HF source (FP8 blocks): bf16 by default, --quantize re-quantizes
    tensors, out_cfg = export_tensors(tensors, cfg, meta_dir, quantize, dtype, carried)
    out.mkdir(parents=True, exist_ok=True)
    write_hf(tensors, config_of(out_cfg), meta_dir, out)
    return len(tensors)


def _with_score_head(stream: Stream, chunks: list) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream`, then on the last pipeline stage the reward model's whole score row
    [1, h] as SCORE_WEIGHT (collective over that stage's TP group: full_head_row)."""
    yield from stream
    head = value_head(chunks)
    if head is not None:
        yield SCORE_WEIGHT, full_head_row(head)


def export_adapter_folder(chunks: list, cfg: dict, spec, base: str, out: Path,
                          dtype: Optional[torch.dtype] = None,
                          held: Optional[torch.dtype] = None) -> int:
    """Collective (module docstring): the LoRA adapters of `chunks` (LoraSpec `spec`, on the
    base HF folder `base`) as a peft adapter folder in `out` (adapter_config.json,
    adapter_model.safetensors); returns the tensor count on rank 0 (0 elsewhere). A reward
    model's (`cfg` is_reward_model_config: the score head trained in full beside the
    adapters) is peft's task_type SEQ_CLS adapter with its score row in modules_to_save, as
    peft 0.21 saves it (`base_model.model.score.weight`)."""
    reward = is_reward_model_config(cfg)
    stream = export_peft_tensors(chunks, peft_layers(cfg))
    stream = _on_host(_with_score_head(stream, chunks) if reward else stream, dtype, held)
    tensors = gather_stages(stream, out)
    if tensors is None:
        return 0
    router = family_of(cfg).lora_hf_paths.get(ROUTER_PATH, ROUTER_PATH)
    saved = {SCORE_MODULE: tensors.pop(SCORE_WEIGHT)} if reward else {}
    write_peft_adapter(tensors, spec, str(base), out, router,
                       task_type="SEQ_CLS" if reward else "CAUSAL_LM", saved_modules=saved)
    return len(tensors) + len(saved)


@dataclass(frozen=True)
class ExportExtras:
    """What a run's objective adds to its checkpoint.save_hf folder beyond convert's common
    export, handed down by the objective's run (a reward model's: engine.rm.export.hf_extras):
    `config_of(cfg, meta_dir)`: the config.json written for the exported HF config `cfg`
    (`meta_dir`: the checkpoint's source folder, its tokenizer); `files(out, meta_dir,
    shown)`: called on rank 0 after the folder's tensors, config and tokenizer are written,
    writes its further files into `out` (`shown`: the folder's path once the checkpoint is
    published) and returns one sentence for the log."""
    config_of: Callable[[dict, Path], dict]
    files: Callable[[Path, Path, Path], str]


def save_hf_problem(hf_config: dict, extras: Optional[ExportExtras], lora: bool
                    ) -> Optional[str]:
    """Why checkpoint.save_hf cannot write the HF folder convert writes of a run of
    `hf_config` (None: it can): a reward model's full folder needs its run's `extras` (its
    config.json, scoring chat template and README; engine.rm.export hands them down). With
    LoRA (`lora`) its folder is the peft adapter, which needs none (export_adapter_folder)."""
    if is_reward_model_config(hf_config) and extras is None and not lora:
        return ("checkpoint.save_hf=true: a reward model's HF folder is written with its "
                "scoring files (engine.rm.export.hf_extras), which this run does not hand "
                "to its saves; leave checkpoint.save_hf=false and run `tools/convert.py "
                "mcore-to-hf --ckpt CHECKPOINT_DIR --out OUT` after the run")
    return None


def save_hf_export(chunks: list, ckpt_dir: Path, hf_config: dict, base: Optional[str],
                   error: Optional[str], extras: Optional[ExportExtras] = None
                   ) -> Optional[str]:
    """Collective, inside a checkpoint save after rank 0 wrote `ckpt_dir`/hf_source/
    (write_metadata) and reported `error` (None: no error; only rank 0's counts): unless rank 0
    failed, write `ckpt_dir`/hf/, the folder `convert mcore-to-hf --ckpt ckpt_dir` writes: the
    full model (with the run's `extras`: ExportExtras), or with LoRA adapters
    (models.lora.sites) the peft adapter on the base `base` (model.hf_path; a reward model's
    with its score head, no `extras`: convert writes none there). Returns rank 0's
    error (a failed write) or `error`; None elsewhere. Rank 0 prints the folder, its tensor
    count and the seconds the export took (the extras' files included)."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        return error
    out, spec = Path(ckpt_dir) / HF_EXPORT_DIR, lora_spec_of(chunks)
    if (problem := save_hf_problem(hf_config, extras, spec is not None)) is not None:
        return problem if dist.get_rank() == 0 else None
    start, meta = time.perf_counter(), source_dir(ckpt_dir)
    shown = Path(ckpt_dir).with_name(Path(ckpt_dir).name.removesuffix(STAGING_SUFFIX)) \
        / HF_EXPORT_DIR
    note = ""
    try:
        if spec is not None:
            n = export_adapter_folder(chunks, hf_config, spec, base, out, held=CONVERT_DTYPE)
        else:
            n = export_model_folder(chunks, hf_config, meta, out, held=CONVERT_DTYPE,
                                    config_of=(lambda c: extras.config_of(c, meta))
                                    if extras is not None else (lambda c: c))
            if extras is not None and dist.get_rank() == 0:
                note = f"; {extras.files(out, meta, shown)}"
    except OSError as e:
        return f"writing {out} failed: {e}" if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        print(f"[checkpoint] {HF_EXPORT_DIR}/ written: {n} tensors in "
              f"{time.perf_counter() - start:.2f} s (checkpoint.save_hf){note}", flush=True)
    return None
