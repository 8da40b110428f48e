"""Structured configuration of the GRPO / DAPO entry point (`python -m engine.rl`).

`RLConfig` reuses the SFT parts (model, data, parallel, moe, optim, loss, logging, checkpoint;
checkpoint.save_interval and train.exit_interval count RL steps) and adds the RL groups.
`algorithm` only chooses defaults; every behaviour is its own key:

presets live in engine.rl.algo.presets (grpo: the schema defaults; dapo: the DAPO paper's). A
key the user set explicitly (on the command line or in the `--config` YAML) keeps the user's
value. `advantage.estimator` and `policy_loss` name entries of the registries in
engine.rl.algo.advantages and engine.rl.algo.policy_loss.

Units: lengths in tokens, times in seconds, `rollout.sync_bucket_mb` in MiB.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from engine.config.moe_settings import MoEConfig
from engine.config.schema import (CheckpointConfig, DataConfig, LoggingConfig, LossConfig,
                                  ModelConfig, OptimConfig, ParallelConfig, RecipeConfig)
from engine.config.rollout_settings import (HFRolloutConfig, RolloutConfig, SGLangConfig,
                                           SpeculativeConfig, VLLMConfig)
from engine.rl.algo.rollout_correction_config import RolloutCorrectionConfig
from engine.training.loss import DEFAULT_LOSS_CHUNK_TOKENS


@dataclass
class RLTrainConfig:
    prompts_per_step: int = 8            # prompts per rollout batch (x rollout.n responses)
    mini_batches_per_step: int = 1       # optimizer steps per rollout batch and epoch
    epochs_per_rollout: int = 1          # passes over the rollout batch
    # the old (proximal) log-probs: auto (from the training forward where the update is exactly
    # on-policy, else a separate pass; engine.rl.policy.old_logprobs) | recompute (always the
    # separate pass)
    old_logprobs: str = "auto"
    # sequences per micro-batch of the updates; with train.prefix_sharing: groups of rows
    # sharing a prefix (a whole GRPO group each; docs/prefix-sharing.md). Null (with
    # max_tokens_per_micro_batch null): a token budget sized from the model and
    # train.seq_length (engine.config.micro_batch_defaults; the run header says it)
    micro_batch_size: Optional[int] = None
    # token budget per micro-batch (replaces micro_batch_size); null: micro_batch_size, or the
    # default budget when that is null too
    max_tokens_per_micro_batch: Optional[int] = None
    max_steps: int = 10                  # RL steps (rollout batches)
    seq_length: int = 512                # longest prompt + response (tokens) allowed
    balance_dp: bool = True              # split each mini-batch over DP ranks by work (as SFT)
    packing: bool = False                # several sequences per row, no padding (as SFT)
    # rows sharing a prefix run it once (as SFT): auto (null too; on where exact for the model
    # and settings, else off) | true (refuses what it cannot do exactly) | false
    prefix_sharing: Optional[str] = "auto"
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
    # the last layer's MLP only at positions a loss reads (models.layers.unread_positions)
    skip_unread_positions: bool = True
    # torch.compile per transformer layer of the policy (and critic) updates: null (on with
    # CUDA; `auto` is its old spelling) | true | false (engine.config.compile_settings)
    compile: Optional[str] = None


@dataclass
class RewardModelConfig:
    """A learned reward model (engine.rl.policy.reward_model; docs/rl.md)."""
    # HF *ForSequenceClassification folder (num_labels 1) scoring the policy's token ids
    path: Optional[str] = None           # null: no reward model
    weight: float = 1.0                  # reward = reward.fn score + weight * the model's score
    offload: bool = False                # its weights in host memory outside its forward pass


JUDGE_PROMPT = ("Rate how well the response answers the prompt, from 0 (wrong) to 10 "
                "(perfect). Reply with the number only.\n\nPrompt:\n{prompt}\n\n"
                "Response:\n{response}\n\nScore:")


@dataclass
class JudgeConfig:
    """An LLM judge at an OpenAI-compatible URL (engine.rl.judge; docs/rl.md)."""
    # the judge's OpenAI base URL, ending in /v1 (e.g. `megatron-sft-engine serve`'s); null: off
    base_url: Optional[str] = None
    model: str = "judge"                 # the model name sent in each request
    prompt: str = JUDGE_PROMPT           # the judge's user message: {prompt}, {response} filled
    # the score in the judge's reply: "number" (the verdict: the last number that is not a
    # denominator, as in 8/10 or 8 out of 10, inside score_range), a regex whose one group is a
    # float (its last match), or "package.module:function" taking the text, returning a float
    parser: str = "number"
    # parser=number's accepted scores [low, high]; a verdict outside is unparsable (scores 0)
    score_range: List[float] = field(default_factory=lambda: [0.0, 10.0])
    weight: float = 1.0                  # reward = reward.fn score + weight * the judge's score
    concurrency: int = 16                # judge requests in flight at once
    timeout_s: float = 60.0              # per request; past it the request scores 0 (an error)
    # the whole judging of one RL step ends by then (below the 1800 s process-group timeout the
    # other ranks wait in); responses not scored by then score 0 and count in reward/errors
    deadline_s: float = 600.0
    api_key_env: Optional[str] = None    # environment variable holding the API key (null: none)
    max_tokens: int = 256                # of the judge's reply
    temperature: float = 0.0             # of the judge's reply (0: greedy)


@dataclass
class RewardConfig:
    # built-in name or "package.module:function"; with reward.model.path or
    # reward.judge.base_url set and reward.fn not given, none (engine.rl.algo.presets)
    fn: str = "math"
    # seconds per call, from its start (a call past it is a failed reward); null: unbounded
    # (reward.num_workers=0 then calls fn one at a time in the trainer)
    timeout_s: Optional[float] = 30.0
    # reward.fn's calls run in this many worker processes (engine.rl.rewards.pool); null: the
    # CPUs this rank may use; 0: in the trainer (threads, as timeout_s says)
    num_workers: Optional[int] = None
    # the score of a call that raised, returned a non-finite value, crashed its worker or ran
    # past timeout_s; null: no score, the reply's group leaves the update (reward/dropped_groups)
    failure_score: Optional[float] = None
    code_score: str = "fraction"         # reward.fn=code: fraction of tests passed | all
    code_sandbox: str = "strict"         # reward.fn=code: strict (refuse a missing layer) | relaxed
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class ClipConfig:
    eps_low: float = 0.2                 # ratio clipped below at 1 - eps_low (A < 0)
    eps_high: float = 0.2                # ratio clipped above at 1 + eps_high (A > 0)
    dual_c: Optional[float] = None       # dual clip (> 1) for negative advantages


@dataclass
class KLConfig:
    beta: float = 0.001                  # 0: no KL term and no reference model
    estimator: str = "k3"                # k1 | k2 | k3


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"              # engine.rl.algo.advantages.ADVANTAGE_ESTIMATORS, gae
    norm_by_std: bool = True             # grpo only; false: Dr. GRPO (r - group mean)
    gamma: float = 1.0                   # gae: discount (verl algorithm.gamma)
    lam: float = 1.0                     # gae: lambda (verl algorithm.lam)


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
    """Multi-turn episodes (engine.rl.env; docs/multi-turn.md)."""

    fn: Optional[str] = None             # null: single-turn | tools | package.module:Class
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the class
    tools: List[str] = field(default_factory=list)  # env.fn=tools: package.module:function
    max_turns: int = 4                   # assistant turns per episode at most
    num_workers: int = 8                 # concurrent environment steps (and tool processes)
    step_timeout_s: Optional[float] = 60.0  # per env step (and per tool call); null: none
    # agents through an OpenAI-compatible endpoint (engine.rl.agent; docs/agents.md)
    agent: Optional[str] = None          # package.module:function(base_url, row); env.fn null
    agent_concurrency: Optional[int] = None  # episodes whose function runs at once; null: all
    agent_timeout_s: float = 600.0       # per episode, from its function's call
    agent_host: str = "127.0.0.1"        # the endpoint's address (loopback by default)
    agent_port: int = 0                  # the endpoint's port; 0: a free one
    # null: open; a key: requests need "Authorization: Bearer KEY" (401 otherwise) and the
    # function is called function(base_url, row, api_key=KEY)
    agent_api_key: Optional[str] = None


@dataclass
class RLLoggingConfig(LoggingConfig):
    rollout_dir: Optional[str] = None    # <dir>/step_<k>.jsonl: every episode (null: off)


@dataclass
class RLDataConfig(DataConfig):
    val_files: list[str] = field(default_factory=list)  # validation prompts (engine.rl.collect.validation)


@dataclass
class ValConfig:
    """Validation (engine.rl.collect.validation; docs/validation.md)."""

    n: int = 1                           # samples per validation prompt (pass@k for k <= n)
    temperature: float = 0.0             # 0: greedy
    before_train: bool = False           # also validate the initial policy (logged as step 0)
    pass_threshold: float = 1.0          # a response passes (pass@k) when its score >= this


@dataclass
class CriticConfig:
    """PPO's critic (advantage.estimator=gae; engine.rl.policy.critic)."""
    hf_path: Optional[str] = None       # null: the policy's initial weights + a zero value head
    lr: float = 1e-5                    # its own optimizer (the rest of optim.* is shared)
    warmup_steps: int = 0               # the critic's linear LR warmup (optimizer steps)
    value_clip: float = 0.5             # verl critic.cliprange_value


@dataclass
class DistillConfig:
    """On-policy distillation (engine.rl.algo.distill; docs/algorithms.md)."""
    teacher_path: Optional[str] = None  # HF model dir sharing the student's tokenizer; null: off
    coef: float = 1.0                   # lambda in A_t - lambda (log pi_old - log pi_teacher)
    # the teacher's weights in host memory between its forward passes (one per step);
    # engine.training.host_offload
    offload: bool = False


@dataclass
class RLConfig:
    algorithm: str = "grpo"              # grpo | ppo | dapo: defaults (engine.rl.algo.presets)
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
    distill: DistillConfig = field(default_factory=DistillConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # steps: RL steps
    recipe: RecipeConfig = field(default_factory=RecipeConfig)  # --validate cluster shape
    policy_loss: str = "ppo_clip"        # engine.rl.algo.policy_loss.POLICY_LOSSES
    entropy_coef: float = 0.0            # loss - entropy_coef x entropy (0: no entropy term)
    seed: int = 1234                     # data order, sampling and RNG


