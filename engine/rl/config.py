"""Structured configuration of the GRPO / DAPO entry point (`python -m engine.rl`).

`RLConfig` reuses the SFT parts (model, data, parallel, moe, optim, loss, logging, checkpoint;
checkpoint.save_interval and train.exit_interval count RL steps) and adds the RL groups.
`algorithm` only chooses defaults; every behaviour is its own key:

presets live in engine.rl.algorithms (grpo: the schema defaults; dapo: the DAPO paper's). A
key the user set explicitly (on the command line or in the `--config` YAML) keeps the user's
value. `advantage.estimator` and `policy_loss` name entries of the registries in
engine.rl.advantages and engine.rl.policy_loss.

Units: lengths in tokens, times in seconds, `rollout.sync_bucket_mb` in MiB.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from engine.config.schema import (CheckpointConfig, DataConfig, LoggingConfig, LossConfig,
                           ModelConfig, OptimConfig, ParallelConfig, RecipeConfig, check_choice,
                           checkpoint_config_problems, raise_problems, shape_problems,
                           split_argv, validate_common)
from engine.config.model_settings import recompute_layer_problems, recompute_problems
from engine.config.moe_settings import MoEConfig
from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
from engine.rl.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.async_check import async_problems, rollout_procs_per_node, split_sizes
from engine.rl.env.contract import env_problems
from engine.rl.algorithms import ALGORITHMS
from engine.rl.policy_loss import KL_ESTIMATORS
from engine.rl.policy_loss_variants import POLICY_LOSSES
from engine.rl.rollout_correction import RolloutCorrectionConfig
from engine.rl.rollout_correction_check import correction_problems
from engine.rl.rewards import load_reward_fn
from engine.rl.routing_replay import routing_replay_problems
from engine.rl.rollout.base import BACKENDS, custom_backend_class
from engine.rl.rollout.placement import placement_problems, procs_per_node
from engine.rl.validation import val_problems


@dataclass
class RLTrainConfig:
    prompts_per_step: int = 8            # prompts per rollout batch (x rollout.n responses)
    mini_batches_per_step: int = 1       # optimizer steps per rollout batch and epoch
    epochs_per_rollout: int = 1          # passes over the rollout batch
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: Optional[int] = None
    max_steps: int = 10                  # RL steps (rollout batches)
    seq_length: int = 512                # longest prompt + response (tokens) allowed
    balance_dp: bool = True
    packing: bool = False
    exit_interval: Optional[int] = None  # stop after an RL step number divisible by this
    exit_duration_mins: Optional[float] = None  # stop after this much wall time (minutes)
    max_consecutive_nonfinite_steps: int = 3  # skipped (inf/NaN) optimizer steps in a row
    recompute: str = "none"              # policy updates: none | selective | full (as SFT)
    recompute_method: Optional[str] = None       # full only: uniform | block (null: uniform)
    recompute_num_layers: Optional[int] = None   # full only: layers per group / block (null: 1)
    val_interval: int = 0                # validate after every N-th RL step (0: off)
    # tokens per chunk of the loss head in policy updates and log-prob recomputation (as SFT);
    # 0 or null: unchunked logits
    loss_chunk_tokens: Optional[int] = DEFAULT_LOSS_CHUNK_TOKENS


@dataclass
class RewardConfig:
    fn: str = "math"                     # built-in name or "package.module:function"
    timeout_s: Optional[float] = 30.0    # per call; null: sequential, no timeout


@dataclass
class SGLangConfig:
    mem_fraction: float = 0.5            # SGLang mem_fraction_static (colocated with training)


@dataclass
class RolloutConfig:
    backend: str = "hf"                  # hf | sglang | package.module:Class
    num_engines: Optional[int] = None    # rollout engines in the job (null: one per node)
    gpus_per_engine: Optional[int] = None  # devices per engine, SGLang tp_size (null: node/engines)
    n: int = 8                           # responses per prompt (the GRPO group size)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    sync_bucket_mb: float = 512.0
    sleep_during_train: bool = False     # release the engine's memory while training
    check_weight_sync: bool = False      # after each sync compare engine vs trainer logits
    max_retries: int = 2                 # generate calls retried after a backend failure
    retry_wait_s: float = 5.0            # wait before retry k: retry_wait_s * 2**(k-1)
    # asynchronous RL (engine.rl.async_check; README "Asynchronous RL")
    placement: str = "colocated"         # colocated | disaggregated (own ranks for rollout)
    num_ranks: Optional[int] = None      # disaggregated: the job's last num_ranks ranks
    max_staleness: int = 0               # batch k generated by policy version max(0, k - s)
    peer_timeout_s: float = 600.0        # disaggregated: longest wait for the other side
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class ClipConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_c: Optional[float] = None       # dual clip (> 1) for negative advantages


@dataclass
class KLConfig:
    beta: float = 0.001                  # 0: no KL term and no reference model
    estimator: str = "k3"                # k1 | k2 | k3


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"              # engine.rl.advantages.ADVANTAGE_ESTIMATORS
    norm_by_std: bool = True             # grpo only; false: Dr. GRPO (r - group mean)


@dataclass
class SAPOConfig:
    tau_pos: float = 1.0                 # gate temperature where A > 0 (verl actor.tau_pos)
    tau_neg: float = 1.05                # gate temperature where A <= 0 (verl actor.tau_neg)


@dataclass
class DAPOConfig:
    dynamic_sampling: bool = False       # drop groups whose scores all agree, generate more
    max_gen_batches: int = 10            # generation batches per step at most
    overlong_buffer: int = 0             # soft overlong punishment over the last N tokens
    overlong_penalty: float = 1.0        # reward at max_new_tokens is -overlong_penalty


@dataclass
class EnvConfig:
    """Multi-turn episodes (engine.rl.env; README "Multi-turn RL")."""

    fn: Optional[str] = None             # null: single-turn | tools | package.module:Class
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the class
    tools: List[str] = field(default_factory=list)  # env.fn=tools: package.module:function
    max_turns: int = 4                   # assistant turns per episode at most
    num_workers: int = 8                 # concurrent environment steps (and tool processes)
    step_timeout_s: Optional[float] = 60.0  # per env step (and per tool call); null: none


@dataclass
class RLLoggingConfig(LoggingConfig):
    rollout_dir: Optional[str] = None    # <dir>/step_<k>.jsonl: every episode (null: off)


@dataclass
class RLDataConfig(DataConfig):
    val_files: list[str] = field(default_factory=list)  # validation prompts (engine.rl.validation)


@dataclass
class ValConfig:
    """Validation (engine.rl.validation; README "Validation")."""

    n: int = 1                           # samples per validation prompt (pass@k for k <= n)
    temperature: float = 0.0             # 0: greedy
    before_train: bool = False           # also validate the initial policy (logged as step 0)
    pass_threshold: float = 1.0          # a response passes (pass@k) when its score >= this


@dataclass
class RLConfig:
    algorithm: str = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)      # MoE policies (engine.config.moe_settings)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: LossConfig = field(default_factory=LossConfig)   # norm_horizon default: max_new_tokens
    logging: RLLoggingConfig = field(default_factory=lambda: RLLoggingConfig(dir="runs/rl"))
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    dapo: DAPOConfig = field(default_factory=DAPOConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)            # policy_loss=sapo
    rollout_correction: RolloutCorrectionConfig = field(            # verl's, same keys
        default_factory=RolloutCorrectionConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    val: ValConfig = field(default_factory=ValConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # steps: RL steps
    recipe: RecipeConfig = field(default_factory=RecipeConfig)  # --validate cluster shape
    policy_loss: str = "ppo_clip"        # engine.rl.policy_loss.POLICY_LOSSES
    entropy_coef: float = 0.0
    seed: int = 1234


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _flatten(v, f"{prefix}{k}.")
        return out or [prefix.rstrip(".")]
    return [prefix.rstrip(".")]


def explicit_keys(argv: list[str]) -> set[str]:
    """Dotted keys the user set: hydra overrides (`a.b=1`, `+a.b=1`, `~a.b`) and every leaf of
    the `--config` / `config=` YAML file."""
    config_file, overrides, _ = split_argv(argv)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if config_file and os.path.isfile(config_file):
        keys |= set(_flatten(OmegaConf.to_container(OmegaConf.load(config_file))))
    return keys


def _is_explicit(key: str, explicit: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in explicit for i in range(1, len(parts) + 1))


def apply_algorithm_defaults(cfg: RLConfig, explicit: set[str]) -> RLConfig:
    """Set the defaults of `cfg.algorithm` (module docstring) on every key not in `explicit`
    (nor under an explicit group). Mutates and returns `cfg`."""
    _check_algorithm(cfg)
    for key, value in ALGORITHMS[cfg.algorithm](cfg).items():
        if not _is_explicit(key, explicit):
            group, name = key.split(".")
            setattr(getattr(cfg, group), name, value)
    return cfg


def _check_algorithm(cfg: RLConfig) -> None:
    """Raise ConfigError unless cfg.algorithm is one of ALGORITHMS."""
    problems: list[str] = []
    check_choice(problems, cfg.algorithm, "algorithm", tuple(ALGORITHMS))
    raise_problems(problems)


def rl_problems(cfg: RLConfig) -> list[str]:
    """Every violated constraint of the RL keys, as sentences naming the key; the checkpoint
    and exit keys through engine.config.schema.checkpoint_config_problems (same messages as SFT)."""
    t, r, c, d = cfg.train, cfg.rollout, cfg.clip, cfg.dapo
    p: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            p.append(message)

    for key in ("prompts_per_step", "mini_batches_per_step", "epochs_per_rollout"):
        value = getattr(t, key)
        check(isinstance(value, int) and value >= 1, f"train.{key}={value!r} must be an "
              "integer >= 1")
    if r.backend not in BACKENDS:
        try:
            custom_backend_class(r.backend)
        except ValueError as e:
            p.append(str(e))
    check(isinstance(r.max_retries, int) and r.max_retries >= 0,
          f"rollout.max_retries={r.max_retries!r} must be an integer >= 0")
    check(r.retry_wait_s >= 0, f"rollout.retry_wait_s={r.retry_wait_s} must be >= 0")
    check(r.n >= 2, f"rollout.n={r.n} must be >= 2 (group-relative advantages need a group)")
    check(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    check(t.seq_length > r.max_new_tokens, f"train.seq_length={t.seq_length} must exceed "
          f"rollout.max_new_tokens={r.max_new_tokens} (room for the prompt)")
    check(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0 (sampling)")
    check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    check(r.sync_bucket_mb > 0, f"rollout.sync_bucket_mb={r.sync_bucket_mb} must be > 0")
    total = t.prompts_per_step * r.n
    check(t.mini_batches_per_step <= total, f"train.mini_batches_per_step="
          f"{t.mini_batches_per_step} exceeds the {total} responses of a rollout batch "
          "(train.prompts_per_step x rollout.n)")
    check(0 <= c.eps_low < 1, f"clip.eps_low={c.eps_low} must be in [0, 1)")
    check(c.eps_high >= 0, f"clip.eps_high={c.eps_high} must be >= 0")
    check(c.dual_c is None or c.dual_c > 1, f"clip.dual_c={c.dual_c} must be > 1 or null")
    check(cfg.kl.beta >= 0, f"kl.beta={cfg.kl.beta} must be >= 0")
    check_choice(p, cfg.kl.estimator, "kl.estimator", KL_ESTIMATORS)
    check_choice(p, cfg.advantage.estimator, "advantage.estimator",
                 tuple(ADVANTAGE_ESTIMATORS))
    check_choice(p, cfg.policy_loss, "policy_loss", tuple(POLICY_LOSSES))
    check(0 < r.sglang.mem_fraction < 1,
          f"rollout.sglang.mem_fraction={r.sglang.mem_fraction} must be in (0, 1)")
    check(d.max_gen_batches >= 1, f"dapo.max_gen_batches={d.max_gen_batches} must be >= 1")
    check(0 <= d.overlong_buffer <= r.max_new_tokens, f"dapo.overlong_buffer="
          f"{d.overlong_buffer} must be in [0, rollout.max_new_tokens={r.max_new_tokens}]")
    check(d.overlong_penalty >= 0, f"dapo.overlong_penalty={d.overlong_penalty} must be >= 0")
    check(cfg.reward.timeout_s is None or cfg.reward.timeout_s > 0,
          f"reward.timeout_s={cfg.reward.timeout_s} must be > 0 or null")
    try:
        load_reward_fn(cfg.reward.fn)
    except ValueError as e:
        p.append(f"reward.fn: {e}")
    return (p + env_problems(cfg) + val_problems(cfg) + correction_problems(cfg)
            + checkpoint_config_problems(cfg))


def validate_rl(cfg: RLConfig, world_size: int) -> dict:
    """validate_common (model, data files, shared values, layout) plus the RL keys; raises one
    ConfigError listing every problem. Returns the HF config dict."""
    _check_algorithm(cfg)
    import torch  # GPU hosts: the rollout ranks are whole nodes
    raise_problems(async_problems(cfg, world_size, procs_per_node(world_size)
                                  if torch.cuda.is_available() else None))
    world_size, n_rollout = split_sizes(cfg, world_size)  # the training world from here on
    hf_config = validate_common(cfg, world_size)
    engine_ranks = n_rollout or world_size
    raise_problems(rl_problems(cfg) + shape_problems(cfg, hf_config)
                   + recompute_problems(cfg.train)
                   + recompute_layer_problems(cfg.parallel, cfg.train,
                                              hf_config["num_hidden_layers"])
                   + placement_problems(cfg.rollout.num_engines, cfg.rollout.gpus_per_engine,
                                        engine_ranks,
                                        rollout_procs_per_node(world_size + n_rollout, n_rollout)
                                        if n_rollout else procs_per_node(world_size))
                   + routing_replay_problems(cfg))
    return hf_config


def rl_validator(argv: list[str]):
    """The `validate` hook for engine.cli.run_entry: algorithm defaults (explicit keys from
    `argv` win), then validate_rl."""
    explicit = explicit_keys(argv)

    def validate(cfg: RLConfig, world_size: int) -> dict:
        apply_algorithm_defaults(cfg, explicit)
        return validate_rl(cfg, world_size)

    return validate
