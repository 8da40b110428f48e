"""Structured configuration (hydra over dataclasses) shared by the SFT and RL entry points.

`load_config(schema, argv)` composes: the schema defaults, then an optional YAML file given as
`--config FILE` (or `config=FILE`), then hydra-style overrides (`train.max_steps=5`,
`data.train_files=[a.jsonl,b.jsonl]`). Unknown keys and wrong types are rejected by hydra with
the key named; `validate_common` (SFT and RL) and `validate_sft` then check values (choices,
paths, layout arithmetic, checkpoint keys) before any process group exists, collecting every
problem (`*_problems`, also used by engine.config.recipe_validation): `ConfigError`, exit 2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from engine.checkpoint.io import list_iterations
from engine.checkpoint.schedule import SCHEDULE_CHOICES
from engine.config.checkpoint_settings import CheckpointConfig
from engine.data.files import SUPPORTED_EXTENSIONS, data_spec_problem
from engine.config.loading import config_yaml, load_config, split_argv
from engine.errors import ConfigError
from engine.training.loss import AGG_MODES, DEFAULT_LOSS_CHUNK_TOKENS
from engine.config.compile_settings import compile_problems
from engine.config.fusion_settings import FusionConfig, fusion_problems
from engine.config.lora_settings import LoraConfig, lora_problems
from engine.config.vision_settings import VisionConfig, vision_problems
from engine.config.mtp_settings import MTPConfig, mtp_problems
from engine.config.prefix_sharing_settings import prefix_sharing_problems
from engine.config.optim_settings import OptimConfig, optim_problems
from engine.config.moe_settings import MoEConfig, moe_problems
from engine.config.model_settings import (loss_chunk_problems, recompute_layer_problems,
                                          recompute_problems, sequence_parallel_on)
from engine.config.parallel_settings import (ParallelConfig, overlap_problems,
                                             resolved_overlap_problems)
from engine.config.tokenizer_settings import remote_code_problems
from engine.config.logging_settings import LoggingConfig, tracker_problems, tracker_start_problems
from models.bridge.head_checks import check_hf_config
from models.families.base import UnsupportedModelError
from models.families.registry import experts_per_layer, family_of
from models.hf.io import HFCheckpointError, read_config, training_dir_problems
from models.families.presets import MODEL_SHAPES, shape_mismatches
from parallel.layout import ParallelLayout

__all__ = ["CheckpointConfig", "ConfigError", "LoggingConfig", "ParallelConfig", "config_yaml",
           "load_config", "split_argv"]  # re-exported


@dataclass
class ModelConfig:
    hf_path: str = ""            # HF model directory (weights, config, tokenizer)
    dtype: str = "float32"       # float32 | bfloat16 (bf16 params, fp32 master weights)
    # A preset of engine.config.recipe_validation.MODEL_SHAPES (e.g. "qwen3-8b"): `--validate`
    # uses it without model.hf_path; a run checks that the HF config at model.hf_path has it.
    shape: Optional[str] = None
    trust_remote_code: bool = False  # run the folder's own tokenizer code (tokenizer_settings)
    fusions: FusionConfig = field(default_factory=FusionConfig)  # engine.config.fusion_settings
    lora: LoraConfig = field(default_factory=LoraConfig)  # engine.config.lora_settings
    vision: VisionConfig = field(default_factory=VisionConfig)  # vision_settings
    mtp: MTPConfig = field(default_factory=MTPConfig)  # engine.config.mtp_settings


@dataclass
class DataConfig:
    # files (.jsonl, .parquet, .arrow), globs, directories, datasets.save_to_disk folders
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # evaluation files (same formats)
    shuffle: bool = True  # seeded shuffle; the order never depends on the world size or layout
    truncation: str = "right"    # right | error
    # rendered-data cache (engine.data.cache); null: $MEGATRON_SFT_DATA_CACHE, else
    # ${XDG_CACHE_HOME:-~/.cache}/megatron_sft_engine/data. Node-local or shared; one process
    # per cache folder builds an entry, the others wait for it.
    cache_dir: Optional[str] = None
    num_workers: Optional[int] = None  # processes rendering a new entry; null: usable cores


@dataclass
class TrainConfig:
    global_batch_size: int = 16          # sequences per optimizer step
    # sequences per micro-batch (accumulation: the rest); with train.prefix_sharing: groups of
    # rows sharing a prefix, each whole (docs/prefix-sharing.md); null with
    # max_tokens_per_micro_batch null: a token budget sized from the model and seq_length
    # (engine.config.micro_batch_defaults; the run header says which)
    micro_batch_size: Optional[int] = None
    max_tokens_per_micro_batch: Optional[int] = None  # token budget (replaces micro_batch_size)
    max_steps: int = 10                  # optimizer steps
    seq_length: int = 512                # max tokens per sequence (see data.truncation)
    balance_dp: bool = True              # split each global batch over DP ranks by work a*L+b*L^2
    packing: bool = False                # several sequences per row, no padding between them
    prefix_sharing: bool = False         # rows sharing a prefix run it once (docs/prefix-sharing.md)
    eval_interval: int = 0               # eval/loss every N steps (0: never); needs eval_files
    exit_interval: Optional[int] = None  # stop after a step number divisible by this
    exit_duration_mins: Optional[float] = None  # stop after this much wall time (minutes)
    max_consecutive_nonfinite_steps: int = 3  # skipped (inf/NaN) steps in a row before stopping
    recompute: str = "none"              # activation recomputation: none | selective | full
    recompute_method: Optional[str] = None       # full only: uniform | block (null: uniform)
    recompute_num_layers: Optional[int] = None   # full only: layers per group / block (null: 1)
    # tokens per chunk of the loss head (engine.config.model_settings); 0 or null: unchunked
    loss_chunk_tokens: Optional[int] = DEFAULT_LOSS_CHUNK_TOKENS
    # the last layer's MLP only at positions a loss reads (models.layers.unread_positions):
    # the same numbers; false runs it everywhere
    skip_unread_positions: bool = True
    # torch.compile per transformer layer: null (on with CUDA; `auto` is its old spelling) |
    # true | false (engine.config.compile_settings)
    compile: Optional[str] = None


@dataclass
class LossConfig:
    # token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    agg_mode: str = "token-mean"
    norm_horizon: Optional[int] = None   # H of seq-mean-token-sum-norm; default train.seq_length
    count_empty_sequences: bool = True   # sequences without trained tokens count in S


@dataclass
class RecipeConfig:
    """Deployment facts of a recipe, read only by `--validate` (never by training)."""

    nodes: int = 1                     # default node count to validate for
    gpus_per_node: int = 8             # default GPUs per node to validate for
    gpu_memory_gib: float = 79.6       # H100 80GB HBM3 (81559 MiB)
    expected_memory_gib: Optional[float] = None  # the per-GPU peak the recipe states


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)   # MoE models (engine.config.moe_settings)
    seed: int = 1234                   # data order and RNG


# ----------------------------------------------------------------------------- validation
# Each *_problems function returns every violated constraint as a sentence naming the key;
# validate_* raise one ConfigError listing them all.

def check_choice(problems: list[str], value: str, key: str, choices: tuple[str, ...]) -> None:
    """Append the standard 'not valid; choose one of' sentence when `value` is not a choice."""
    if value not in choices:
        problems.append(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(problems: list[str], value, key: str, allow_zero: bool = False,
              optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        problems.append(f"{key}={value!r} must be {'null or ' if optional else ''}an integer "
                        f"{bound}")


def raise_problems(problems: list[str]) -> None:
    """Raise ConfigError naming every problem (the problem itself when there is one)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def read_model_config(cfg) -> dict:
    """The HF config dict at model.hf_path; raises ConfigError when the folder or its
    config.json is unreadable, the architecture is not supported, or a config field that
    changes the math does not map exactly (models.hf.config: one line naming the field)."""
    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path is required (an HF model directory)")
    return read_hf_config(cfg.model.hf_path, "model.hf_path")


def read_hf_config(path: str, key: str) -> dict:
    """The checked HF config dict at `path` (the value of config key `key`, named in the
    ConfigError read_model_config describes)."""
    try:
        hf_config = read_config(path)
        check_hf_config(hf_config)   # transformers' config classes: loaded at the first folder
    except (HFCheckpointError, UnsupportedModelError) as e:
        raise ConfigError(f"{key}={path}: {e}") from None
    return hf_config


def data_file_problems(cfg, require_train: bool = True) -> list[str]:
    """Missing data files, globs without a match, files of an unsupported format, a negative
    data.num_workers (and no train_files at all when `require_train`)."""

    problems = []
    if require_train and not cfg.data.train_files:
        problems.append("data.train_files is empty; give one or more .jsonl/.parquet files: "
                        "data.train_files=[a.jsonl,b.parquet]")
    for key in ("train_files", "eval_files", "val_files"):  # val_files: RL only
        for f in getattr(cfg.data, key, ()):
            ext = os.path.splitext(f)[1].lower()
            if os.path.isdir(f) or set("*?[") & set(f):
                problem = data_spec_problem(f)
                if problem:
                    problems.append(f"data.{key}: {problem}")
            elif ext not in SUPPORTED_EXTENSIONS:
                problems.append(f"data.{key}: {f} has extension {ext or '(none)'!r}; supported: "
                                f"{', '.join(SUPPORTED_EXTENSIONS)} (JSON lines, Parquet, Arrow), "
                                "or a directory or glob of them")
            elif not os.path.isfile(f):
                problems.append(f"data.{key}: file not found: {f}")
    workers = getattr(cfg.data, "num_workers", None)
    if workers is not None and workers < 0:
        problems.append(f"data.num_workers={workers} must be >= 0 (0: render in the training "
                        "process; null: one worker per usable core)")
    return problems


def model_dir_problems(cfg) -> list[str]:
    """What the folder at model.hf_path lacks for training (weights, tokenizer, chat template,
    trust_remote_code; a classifier only for engine.rm, whose config has an `rm` section)."""
    return [f"model.hf_path={cfg.model.hf_path}: {p}" for p in training_dir_problems(
        cfg.model.hf_path, classifier_ok=hasattr(cfg, "rm"))] + remote_code_problems(cfg)


def value_problems(cfg) -> list[str]:
    """Choices and ranges of the keys shared by SFT and RL (no file system access)."""
    p: list[str] = []
    check_choice(p, cfg.model.dtype, "model.dtype", ("float32", "bfloat16"))
    check_choice(p, cfg.data.truncation, "data.truncation", ("right", "error"))
    check_choice(p, cfg.loss.agg_mode, "loss.agg_mode", AGG_MODES)
    check_choice(p, cfg.optim.schedule, "optim.schedule", ("cosine", "constant"))
    check_choice(p, cfg.parallel.cp_comm_type, "parallel.cp_comm_type", ("a2a", "p2p", "all_gather"))
    _positive(p, cfg.train.max_steps, "train.max_steps")
    _positive(p, cfg.train.seq_length, "train.seq_length")
    _positive(p, cfg.train.micro_batch_size, "train.micro_batch_size",
              optional=True)   # RL's null: engine.config.micro_batch_defaults
    _positive(p, cfg.train.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch",
              optional=True)
    _positive(p, cfg.train.max_consecutive_nonfinite_steps,
              "train.max_consecutive_nonfinite_steps")
    p += loss_chunk_problems(cfg.train) + compile_problems(cfg.train)
    if len(cfg.optim.betas) != 2:
        p.append(f"optim.betas={list(cfg.optim.betas)} must hold two numbers")
    return (p + optim_problems(cfg.optim) + overlap_problems(cfg) + fusion_problems(cfg)
            + tracker_problems(cfg))


def parallel_layout(parallel_cfg, world_size: int) -> ParallelLayout:
    """The ParallelLayout of the parallel.* keys at `world_size` (sequence parallelism
    resolved: null means on at tp > 1)."""
    p = parallel_cfg
    return ParallelLayout(world_size, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp,
                          sequence_parallel=sequence_parallel_on(p), ep=p.ep)


def layout_problems(cfg, world_size: int, hf_config: dict) -> list[str]:
    """ParallelLayout constraints of cfg.parallel at `world_size` for this model shape."""
    layout = parallel_layout(cfg.parallel, world_size)
    return layout.problems(num_layers=hf_config["num_hidden_layers"],
                           num_heads=hf_config["num_attention_heads"],
                           num_kv_heads=hf_config.get("num_key_value_heads"),
                           seq_length=cfg.train.seq_length,
                           num_experts=experts_per_layer(hf_config)) + family_of(
        hf_config).layout_problems(hf_config, cfg.parallel.tp, cfg.parallel.cp)


def length_problems(cfg, hf_config: dict) -> list[str]:
    """train.seq_length beyond what the model's family maps exactly (Family.length_limit:
    Mixtral's sliding window)."""
    limit = family_of(hf_config).length_limit(hf_config)
    if limit is None or cfg.train.seq_length <= limit[0]:
        return []
    return [f"train.seq_length={cfg.train.seq_length} exceeds the model's {limit[1]} "
            "(config.json): HF masks keys that far behind a query, which the bridge does not "
            f"implement; supported: train.seq_length <= {limit[0]}"]


def validate_common(cfg, world_size: int) -> dict:
    """Checks shared by SFT and RL; returns the HF config dict. Runs before process groups."""
    hf_config = read_model_config(cfg)
    raise_problems(model_dir_problems(cfg) + data_file_problems(cfg) + value_problems(cfg)
                   + layout_problems(cfg, world_size, hf_config) + moe_problems(cfg, hf_config)
                   + length_problems(cfg, hf_config) + resolved_overlap_problems(cfg)
                   + lora_problems(cfg, hf_config) + vision_problems(cfg, hf_config)
                   + mtp_problems(cfg, hf_config) + tracker_start_problems(cfg)
                   + prefix_sharing_problems(cfg, hf_config))
    return hf_config


def sft_problems(cfg) -> list[str]:
    """SFT-only keys: train.global_batch_size, the eval interval, the values of
    train.recompute* (engine.config.model_settings), and (shared with RL)
    checkpoint_config_problems."""
    p: list[str] = []
    _positive(p, cfg.train.global_batch_size, "train.global_batch_size")
    _positive(p, cfg.train.eval_interval, "train.eval_interval", allow_zero=True)
    return p + recompute_problems(cfg.train) + checkpoint_config_problems(cfg)


def checkpoint_config_problems(cfg) -> list[str]:
    """The checkpoint and exit keys shared by SFT and RL (cfg.checkpoint, train.exit_interval,
    train.exit_duration_mins): ranges, checkpoint.dir, checkpoint.resume (reads the file
    system: the resume path must exist; resume=never needs a checkpoint.dir without
    checkpoints)."""
    p: list[str] = []
    ck = cfg.checkpoint
    _positive(p, ck.save_interval, "checkpoint.save_interval", allow_zero=True)
    _positive(p, ck.keep_last, "checkpoint.keep_last", optional=True)
    _positive(p, cfg.train.exit_interval, "train.exit_interval", optional=True)
    if cfg.train.exit_duration_mins is not None and not cfg.train.exit_duration_mins > 0:
        p.append(f"train.exit_duration_mins={cfg.train.exit_duration_mins!r} must be null or "
                 "> 0")
    if ck.dir is not None and os.path.exists(ck.dir) and not os.path.isdir(ck.dir):
        p.append(f"checkpoint.dir={ck.dir} exists and is not a directory")
    if ck.save_hf and not ck.dir:
        p.append("checkpoint.save_hf=true needs a checkpoint.dir (the HF folder is written "
                 "into each saved checkpoint)")
    check_choice(p, ck.schedule, "checkpoint.schedule", SCHEDULE_CHOICES)
    if ck.resume not in ("auto", "never") and not os.path.isdir(ck.resume):
        p.append(f"checkpoint.resume={ck.resume!r}: no such directory; use auto, never or the "
                 "path of a checkpoint (iter_NNNNNNN) or of a run's checkpoint.dir")
    if ck.resume == "never" and ck.dir and list_iterations(ck.dir):
        p.append(f"checkpoint.dir={ck.dir} already holds checkpoints (up to iter_"
                 f"{list_iterations(ck.dir)[-1]:07d}) and checkpoint.resume=never: use an empty "
                 "checkpoint.dir, or checkpoint.resume=auto to continue that run")
    return p


def shape_problems(cfg, hf_config: dict) -> list[str]:
    """model.shape: a known preset, and (when given) the same shape as `hf_config`."""
    if cfg.model.shape is None:
        return []
    if cfg.model.shape not in MODEL_SHAPES:
        return [f"model.shape={cfg.model.shape!r} is not a known preset; choose one of "
                f"{', '.join(MODEL_SHAPES)} (or leave it null)"]
    return [f"model.shape={cfg.model.shape} does not match model.hf_path={cfg.model.hf_path}: "
            f"{m}" for m in shape_mismatches(MODEL_SHAPES[cfg.model.shape], hf_config)]


def validate_sft(cfg, world_size: int) -> dict:
    """validate_common plus the SFT-only keys (checkpoint, exits, eval, model.shape,
    train.recompute_num_layers against the model's layers per pipeline chunk)."""
    hf_config = validate_common(cfg, world_size)
    raise_problems(sft_problems(cfg) + shape_problems(cfg, hf_config)
                   + recompute_layer_problems(cfg.parallel, cfg.train,
                                              hf_config["num_hidden_layers"]))
    return hf_config
