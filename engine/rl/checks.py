"""Every check of the RL keys (docs/rl.md), before any process group exists (`validate_rl`,
the entry point's validate hook) and in `--validate` (engine.rl.recipe_check): one sentence per
problem, naming its key and the valid choices; what is not implemented is refused by name."""
from __future__ import annotations

import os

import torch

from engine.config.model_settings import recompute_layer_problems, recompute_problems
from engine.config.schema import (check_choice, checkpoint_config_problems, layout_problems,
                                  raise_problems, read_hf_config, shape_problems, validate_common)
from engine.errors import ConfigError
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.algo.gae import TOKEN_ESTIMATORS
from engine.rl.algo.policy_loss import KL_ESTIMATORS
from engine.rl.algo.policy_loss_variants import POLICY_LOSSES
from engine.rl.algo.rollout_correction_config import IS_LEVELS, LOSS_TYPES, parse_rs
from engine.rl.disaggregated.checks import async_problems
from engine.rl.collect.partial_checks import partial_model_problems, partial_problems
from engine.rl.config import RLConfig
from engine.rl.agent.checks import agent_problems
from engine.rl.env.contract import ENV_TOOLS, load_env_class
from engine.rl.env.episode_batch import env_template_problem
from engine.rl.env.tool_schema import load_tools
from engine.rl.env.tools_env import tool_kwargs_problems
from engine.rl.judge.checks import judge_problems
from engine.rl.policy.old_logprobs import old_logprobs_problems
from engine.rl.policy.reward_model_checks import (reward_key_problems, reward_model_problems,
                                                  vocabulary_problem)
from engine.rl.rewards.settings import reward_settings_problems
from engine.generation.base import (BACKENDS, backend_class, conditional_checkpoint_problems,
                                    custom_backend_class)
from engine.generation.hf.settings import hf_problems
from engine.generation.placement import (placement_problems, procs_per_node, rollout_procs_per_node,
                                         split_sizes)
from engine.generation.sglang.settings import sglang_problems
from engine.generation.sync.handles import TRANSPORTS
from engine.generation.sync.quantization import sync_quantization_problems
from engine.generation.vllm.settings import vllm_problems
from models.bridge.head_checks import critic_problem

def rl_problems(cfg: RLConfig) -> list[str]:
    """Every violated constraint of the RL keys, as sentences naming the key; the checkpoint
    and exit keys through engine.config.schema.checkpoint_config_problems (same messages as SFT)."""
    train, rollout, clip, dapo = cfg.train, cfg.rollout, cfg.clip, cfg.dapo
    p: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            p.append(message)

    for key in ("prompts_per_step", "mini_batches_per_step", "epochs_per_rollout"):
        value = getattr(train, key)
        check(isinstance(value, int) and value >= 1, f"train.{key}={value!r} must be an "
              "integer >= 1")
    if rollout.backend not in BACKENDS:
        try:
            custom_backend_class(rollout.backend)
        except ValueError as e:
            p.append(str(e))
    check(isinstance(rollout.max_retries, int) and rollout.max_retries >= 0,
          f"rollout.max_retries={rollout.max_retries!r} must be an integer >= 0")
    check(rollout.retry_wait_s >= 0,
          f"rollout.retry_wait_s={rollout.retry_wait_s} must be >= 0")
    check(rollout.n >= 2,
          f"rollout.n={rollout.n} must be >= 2 (group-relative advantages need a group)")
    check(rollout.max_new_tokens >= 1,
          f"rollout.max_new_tokens={rollout.max_new_tokens} must be >= 1")
    check(train.seq_length > rollout.max_new_tokens, f"train.seq_length={train.seq_length} must "
          f"exceed rollout.max_new_tokens={rollout.max_new_tokens} (room for the prompt)")
    check(rollout.temperature > 0,
          f"rollout.temperature={rollout.temperature} must be > 0 (sampling)")
    check(0 < rollout.top_p <= 1, f"rollout.top_p={rollout.top_p} must be in (0, 1]")
    check(rollout.sync_bucket_mb > 0,
          f"rollout.sync_bucket_mb={rollout.sync_bucket_mb} must be > 0")
    check_choice(p, rollout.sync_transport, "rollout.sync_transport", TRANSPORTS)
    total = train.prompts_per_step * rollout.n
    check(train.mini_batches_per_step <= total, f"train.mini_batches_per_step="
          f"{train.mini_batches_per_step} exceeds the {total} responses of a rollout batch "
          "(train.prompts_per_step x rollout.n)")
    check(0 <= clip.eps_low < 1, f"clip.eps_low={clip.eps_low} must be in [0, 1)")
    check(clip.eps_high >= 0, f"clip.eps_high={clip.eps_high} must be >= 0")
    check(clip.dual_c is None or clip.dual_c > 1,
          f"clip.dual_c={clip.dual_c} must be > 1 or null")
    check(cfg.kl.beta >= 0, f"kl.beta={cfg.kl.beta} must be >= 0")
    check_choice(p, cfg.kl.estimator, "kl.estimator", KL_ESTIMATORS)
    check_choice(p, cfg.advantage.estimator, "advantage.estimator",
                 tuple(ADVANTAGE_ESTIMATORS) + TOKEN_ESTIMATORS)
    check_choice(p, cfg.policy_loss, "policy_loss", tuple(POLICY_LOSSES))
    check(0 < rollout.sglang.mem_fraction < 1,
          f"rollout.sglang.mem_fraction={rollout.sglang.mem_fraction} must be in (0, 1)")
    if rollout.backend == "sglang":
        p += sglang_problems(rollout.sleep_during_train)
    check(dapo.max_gen_batches >= 1, f"dapo.max_gen_batches={dapo.max_gen_batches} must be >= 1")
    check(0 <= dapo.overlong_buffer <= rollout.max_new_tokens,
          f"dapo.overlong_buffer={dapo.overlong_buffer} must be in "
          f"[0, rollout.max_new_tokens={rollout.max_new_tokens}]")
    check(dapo.overlong_penalty >= 0,
          f"dapo.overlong_penalty={dapo.overlong_penalty} must be >= 0")
    check(cfg.reward.timeout_s is None or cfg.reward.timeout_s > 0,
          f"reward.timeout_s={cfg.reward.timeout_s} must be > 0 or null")
    p += reward_settings_problems(cfg.reward)   # fn, num_workers, failure_score, code_*
    return (p + reward_key_problems(cfg) + judge_problems(cfg) + env_problems(cfg)
            + val_problems(cfg) + correction_problems(cfg) + old_logprobs_problems(cfg)
            + partial_problems(cfg)
            + checkpoint_config_problems(cfg))


def validate_rl(cfg: RLConfig, world_size: int) -> dict:
    """validate_common (model, data files, shared values, layout) plus the RL keys; raises one
    ConfigError listing every problem. Returns the HF config dict."""
    gpu_node = procs_per_node(world_size) if torch.cuda.is_available() else None
    raise_problems(async_problems(cfg, world_size, gpu_node))  # GPU: rollout on whole nodes
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
                   + routing_replay_problems(cfg) + distill_problems(cfg, world_size)
                   + reward_model_problems(cfg, world_size, hf_config)
                   + ppo_problems(cfg) + conditional_checkpoint_problems(cfg, hf_config)
                   + partial_model_problems(cfg, hf_config)
                   + sync_quantization_problems(cfg, hf_config) + vllm_problems(cfg, hf_config)
                   + hf_problems(cfg, hf_config))
    return hf_config


def ppo_problems(cfg: RLConfig) -> list[str]:
    """advantage.estimator=gae (PPO's critic): the ranges of advantage.* and critic.*."""
    if cfg.advantage.estimator != "gae":
        return []
    adv, critic = cfg.advantage, cfg.critic
    loaded = critic_problem(critic.hf_path, cfg.model.hf_path) if critic.hf_path else None
    bad = [(not 0 <= adv.gamma <= 1, f"advantage.gamma={adv.gamma} must be in [0, 1]"),
           (not 0 <= adv.lam <= 1, f"advantage.lam={adv.lam} must be in [0, 1]"),
           (not critic.lr > 0, f"critic.lr={critic.lr} must be > 0"),
           (not (isinstance(critic.warmup_steps, int) and critic.warmup_steps >= 0),
            f"critic.warmup_steps={critic.warmup_steps!r} must be an integer >= 0"),
           (not critic.value_clip > 0, f"critic.value_clip={critic.value_clip} must be > 0"),
           (loaded is not None, f"critic.hf_path={critic.hf_path}: {loaded}"),
           (cfg.rollout.placement == "disaggregated", "rollout.placement=disaggregated is not "
            "built with advantage.estimator=gae")]
    return [message for wrong, message in bad if wrong]


def distill_problems(cfg: RLConfig, world_size: int) -> list[str]:
    """distill.*: coef > 0; a teacher directory of a supported family that fits the training
    layout and shares the student's tokenizer; colocated placement; no dynamic sampling with
    reward.fn=none (every group would be dropped); offload a boolean, true only with a
    teacher."""
    path, coef, offload = cfg.distill.teacher_path, cfg.distill.coef, cfg.distill.offload
    if not isinstance(offload, bool):
        return [f"distill.offload={offload!r} must be true or false"]
    if path is None:
        return ["distill.offload=true needs a teacher (distill.teacher_path is null)"
                ] if offload else []
    p = [] if isinstance(coef, (int, float)) and 0 < coef < float("inf") else [
        f"distill.coef={coef!r} must be a number > 0"]
    if cfg.rollout.placement == "disaggregated":
        p.append("distill.teacher_path is colocated only (rollout.placement=disaggregated)")
    if cfg.reward.fn == "none" and not cfg.reward.model.path and cfg.dapo.dynamic_sampling:
        p.append("dapo.dynamic_sampling=true with reward.fn=none drops every group (all "
                 "rewards are 0); turn dynamic sampling off for pure distillation")
    try:
        teacher = read_hf_config(path, "distill.teacher_path")
        vocab = vocabulary_problem(cfg, path, "distill.teacher_path",
                                   "the teacher must share the student's vocabulary")
    except (ConfigError, OSError, ValueError) as e:
        return p + [str(e) if str(e).startswith("distill.") else
                    f"distill.teacher_path={path}: {e}"]
    return p + ([vocab] if vocab else []) + [f"distill.teacher_path={path}: {m}"
                                            for m in layout_problems(cfg, world_size, teacher)]


def correction_problems(cfg) -> list[str]:
    """Every violated constraint, as sentences naming the key and the valid values."""
    corr = cfg.rollout_correction
    p: list[str] = []
    if corr.rollout_is is not None and corr.rollout_is not in IS_LEVELS:
        p.append(f"rollout_correction.rollout_is={corr.rollout_is!r} is not valid; choose one of "
                 f"null, {', '.join(IS_LEVELS)}")
    if not (isinstance(corr.rollout_is_threshold, (int, float)) and corr.rollout_is_threshold > 0):
        p.append(f"rollout_correction.rollout_is_threshold={corr.rollout_is_threshold!r} must be "
                 "a number > 0 (the upper truncation of the IS weight)")
    if corr.rollout_rs is not None:
        try:
            parse_rs(corr.rollout_rs, corr.rollout_rs_threshold)
        except ValueError as e:
            p.append(str(e))
    elif corr.rollout_rs_threshold is not None:
        p.append(f"rollout_correction.rollout_rs_threshold={corr.rollout_rs_threshold!r} is "
                 "set but rollout_correction.rollout_rs is null (set both, or neither)")
    if corr.loss_type not in LOSS_TYPES:
        p.append(f"rollout_correction.loss_type={corr.loss_type!r} is not valid; choose one of "
                 f"{', '.join(LOSS_TYPES)}")
    if corr.bypass_mode:
        if cfg.policy_loss != "ppo_clip":
            p.append(f"rollout_correction.bypass_mode=true replaces policy_loss with "
                     f"rollout_correction.loss_type (verl's bypass loss); policy_loss="
                     f"{cfg.policy_loss!r} cannot be combined with it (leave policy_loss=ppo_clip)")
        if corr.rollout_is_batch_normalize:
            p.append("rollout_correction.rollout_is_batch_normalize=true needs the IS weights of "
                     "the whole batch before the first micro-batch, but bypass_mode=true computes "
                     "them from the current policy inside each micro-batch; use it in decoupled "
                     "mode (bypass_mode=false)")
    elif corr.loss_type != "ppo_clip":
        p.append(f"rollout_correction.loss_type={corr.loss_type!r} applies only with "
                 "rollout_correction.bypass_mode=true (decoupled mode uses policy_loss)")
    if corr.rollout_is_batch_normalize and corr.rollout_is is None:
        p.append("rollout_correction.rollout_is_batch_normalize=true needs "
                 "rollout_correction.rollout_is (token or sequence)")
    for key in ("tau_pos", "tau_neg"):
        value = getattr(cfg.sapo, key)
        if not value > 0:
            p.append(f"sapo.{key}={value} must be > 0")
    return p


def val_problems(cfg) -> list[str]:
    """The val.* / train.val_interval / data.val_files checks (before any process group)."""
    v, t, files = cfg.val, cfg.train, cfg.data.val_files
    p = []
    if not isinstance(t.val_interval, int) or t.val_interval < 0:
        p.append(f"train.val_interval={t.val_interval!r} must be an integer >= 0 (0: off)")
    if not isinstance(v.n, int) or v.n < 1:
        p.append(f"val.n={v.n!r} must be an integer >= 1")
    if v.temperature < 0:
        p.append(f"val.temperature={v.temperature} must be >= 0 (0: greedy)")
    elif v.temperature == 0 and isinstance(v.n, int) and v.n > 1:
        p.append(f"val.n={v.n} with val.temperature=0 (greedy) would repeat one response "
                 f"{v.n} times; use val.n=1 or a val.temperature > 0")
    wanted = bool(t.val_interval) or v.before_train
    if wanted and not files:
        p.append("train.val_interval / val.before_train need data.val_files (validation "
                 "prompts, rows like data.train_files)")
    if files and not wanted:
        p.append("data.val_files is set but validation never runs: set train.val_interval "
                 "(RL steps between validations) and/or val.before_train=true")
    return p


def env_problems(cfg) -> list[str]:
    """Sentences naming each violated env.* key (checked before any process group starts)."""
    env = cfg.env
    p: list[str] = agent_problems(cfg)
    if env.fn is None:
        if env.tools:
            p.append(f"env.tools={list(env.tools)} needs env.fn=tools")
        return p
    if env.fn == ENV_TOOLS:
        if not env.tools:
            p.append("env.fn=tools needs env.tools=['package.module:function', ...]")
        else:
            try:
                load_tools(list(env.tools))
            except ValueError as err:
                p.append(str(err))
        if isinstance(env.kwargs, dict):
            p += tool_kwargs_problems(env.kwargs)
    else:
        if env.tools:
            p.append(f"env.tools applies only to env.fn=tools, not env.fn={env.fn!r}")
        try:
            load_env_class(env.fn)
        except ValueError as err:
            p.append(f"{err} (choose null, tools, or package.module:Class)")
    if not isinstance(env.max_turns, int) or env.max_turns < 1:
        p.append(f"env.max_turns={env.max_turns!r} must be an integer >= 1")
    if not isinstance(env.num_workers, int) or env.num_workers < 1:
        p.append(f"env.num_workers={env.num_workers!r} must be an integer >= 1")
    if env.step_timeout_s is not None and not env.step_timeout_s > 0:
        p.append(f"env.step_timeout_s={env.step_timeout_s} must be > 0 or null")
    if not isinstance(env.kwargs, dict):
        p.append(f"env.kwargs must be a mapping, got {type(env.kwargs).__name__}")
    hf_path = getattr(cfg.model, "hf_path", None)
    if not p and hf_path and os.path.isfile(os.path.join(hf_path, "tokenizer_config.json")):
        problem = env_template_problem(cfg)  # the chat template's needs, before any process
        if problem is not None:
            p.append(problem)
    return p


def routing_replay_problems(cfg) -> list[str]:
    """moe.routing_replay against the RL keys (its value, dense models, SFT and capacity are
    checked by engine.config.moe_settings): R3 needs a backend that reports routed experts and
    single-turn rollouts; R2 needs the old-log-prob forward (no bypass mode)."""
    mode = cfg.moe.routing_replay
    p: list[str] = []
    correction = getattr(cfg, "rollout_correction", None)
    if mode == "R2" and getattr(correction, "bypass_mode", False):
        p.append("moe.routing_replay=R2 records the routing in the old-log-prob forward, which "
                 "rollout_correction.bypass_mode=true skips; use R3 or bypass_mode=false")
    if mode != "R3":
        return p
    env = getattr(cfg, "env", None)
    if getattr(env, "agent", None):
        p.append(f"moe.routing_replay=R3 with env.agent={env.agent!r}: agent episodes do not "
                 "carry the rollout engine's routed experts; use R2")
    if getattr(env, "fn", None):
        p.append(f"moe.routing_replay=R3 with env.fn={env.fn!r}: multi-turn episodes do not "
                 "carry the rollout engine's routed experts; use R2")
    try:
        problem = backend_class(cfg.rollout.backend).routed_experts_problem()
    except (ValueError, ImportError):  # an unknown backend is reported by rl_problems
        return p
    if problem:
        p.append(f"moe.routing_replay=R3 needs the rollout engine's routed experts, but "
                 f"rollout.backend={cfg.rollout.backend}: {problem}")
    return p
