"""Structured configuration (hydra over dataclasses) shared by the SFT and RL entry points.

`load_config(schema, argv)` composes: the schema defaults, then an optional YAML file given as
`--config FILE` (or `config=FILE`), then hydra-style overrides (`train.max_steps=5`,
`data.train_files=[a.jsonl,b.jsonl]`). Unknown keys and wrong types are rejected by hydra with
the key named; `validate_common` then checks values (choices, paths, layout arithmetic) before
any process group exists. Errors raise `ConfigError`; entry points print it once and exit 2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.loss import AGG_MODES


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the constraint and valid values."""


@dataclass
class ModelConfig:
    hf_path: str = ""            # HF model directory (weights, config, tokenizer)
    dtype: str = "float32"       # float32 | bfloat16 (bf16 params, fp32 master weights)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    shuffle: bool = True
    truncation: str = "right"    # right | error


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    cp_comm_type: str = "a2a"    # a2a | p2p | all_gather (p2p/all_gather need Transformer Engine)


@dataclass
class TrainConfig:
    global_batch_size: int = 16
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: Optional[int] = None
    max_steps: int = 10
    seq_length: int = 512
    balance_dp: bool = True
    packing: bool = False
    eval_interval: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    schedule: str = "cosine"     # cosine | constant
    distributed_optimizer: bool = True


@dataclass
class LossConfig:
    agg_mode: str = "token-mean"
    norm_horizon: Optional[int] = None   # H of seq-mean-token-sum-norm; default train.seq_length
    count_empty_sequences: bool = True


@dataclass
class LoggingConfig:
    dir: Optional[str] = "runs/sft"
    progress_bar: bool = True


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 1234


def _split_argv(argv: list[str]) -> tuple[Optional[str], list[str], list[str]]:
    """(config file, overrides, flags like --validate)."""
    config_file, overrides, flags = None, [], []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_file = next(it, None)
        elif arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("--"):
            flags.append(arg)
        else:
            overrides.append(arg)
    return config_file, overrides, flags


def load_config(schema: type, argv: list[str]) -> tuple[Any, list[str]]:
    """Compose schema defaults, an optional YAML file and hydra overrides into a `schema`
    instance. Returns (config, flags)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config_file, overrides, flags = _split_argv(argv)
    try:
        base = OmegaConf.structured(schema)
        if config_file:
            if not os.path.isfile(config_file):
                raise ConfigError(f"config file not found: {config_file}")
            base = OmegaConf.merge(base, OmegaConf.load(config_file))
        name = f"_run_{schema.__name__}"
        ConfigStore.instance().store(name=name, node=base)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=os.path.abspath(os.path.dirname(__file__)),
                                   version_base=None):
            cfg = compose(config_name=name, overrides=overrides)
        return OmegaConf.to_object(cfg), flags
    except ConfigError:
        raise
    except (OmegaConfBaseException, Exception) as e:  # hydra wraps errors in several types
        parts, err = [], e
        while err is not None:
            text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
            if text and text not in parts:
                parts.append(text)
            err = err.__cause__ or err.__context__
        detail = "; ".join(parts)
        raise ConfigError(f"invalid configuration: {detail}") from None


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(value, key: str, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, int) or not ok:
        raise ConfigError(f"{key}={value!r} must be an integer {'>= 0' if allow_zero else '> 0'}")


def validate_common(cfg, world_size: int) -> dict:
    """Checks shared by SFT and RL; returns the HF config dict. Runs before process groups."""
    from models.architectures import UnsupportedArchitectureError, architecture_of
    from models.hf_io import HFCheckpointError, read_config
    from parallel.layout import LayoutError, ParallelLayout

    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path is required (an HF model directory)")
    try:
        hf_config = read_config(cfg.model.hf_path)
        architecture_of(hf_config)
    except (HFCheckpointError, UnsupportedArchitectureError) as e:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path}: {e}") from None
    _choice(cfg.model.dtype, "model.dtype", ("float32", "bfloat16"))
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; give one or more .jsonl/.parquet files")
    for key in ("train_files", "eval_files"):
        for f in getattr(cfg.data, key):
            if not os.path.isfile(f):
                raise ConfigError(f"data.{key}: file not found: {f}")
    _choice(cfg.data.truncation, "data.truncation", ("right", "error"))
    _choice(cfg.loss.agg_mode, "loss.agg_mode", AGG_MODES)
    _choice(cfg.optim.schedule, "optim.schedule", ("cosine", "constant"))
    _choice(cfg.parallel.cp_comm_type, "parallel.cp_comm_type", ("a2a", "p2p", "all_gather"))
    _positive(cfg.train.max_steps, "train.max_steps")
    _positive(cfg.train.seq_length, "train.seq_length")
    _positive(cfg.train.micro_batch_size, "train.micro_batch_size")
    if cfg.train.max_tokens_per_micro_batch is not None:
        _positive(cfg.train.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must hold two numbers")
    layout = ParallelLayout(world_size, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                            vpp=cfg.parallel.vpp, cp=cfg.parallel.cp)
    try:
        layout.validate(num_layers=hf_config["num_hidden_layers"],
                        num_heads=hf_config["num_attention_heads"],
                        num_kv_heads=hf_config.get("num_key_value_heads"),
                        seq_length=cfg.train.seq_length)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return hf_config
