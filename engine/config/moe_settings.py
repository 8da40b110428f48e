"""The `moe.*` keys: how mixture-of-experts layers are trained (any MoE family of
models.families: Qwen3-MoE, Mixtral).

- `moe.token_dispatcher`: megatron's token dispatcher between the router and the experts.
  `alltoall` (default, CPU/gloo and GPUs): exchanges each rank's tokens with the EP ranks
  holding their experts, with per-rank token counts, so DP ranks may run micro-batches of
  different lengths. `allgather`: gathers every rank's tokens; it needs the same token count
  on every rank of the EP group, which the engine's token-balanced micro-batches do not
  give, so it is accepted only with parallel.ep=1.
- `moe.aux_loss_coeff` (null: the HF config's `router_aux_loss_coef` when its
  `output_router_logits` is true, as HF adds the loss only then, else 0; 0 disables) and
  `moe.aux_loss_type`: megatron's load-balancing loss `aux_loss` (per micro-batch),
  `seq_aux_loss` (per sequence row) or `global_aux_loss` (expert loads accumulated over
  the DP group and the step's micro-batches).
- `moe.z_loss_coeff` (null or 0: off): megatron's router z-loss.
- `moe.capacity_factor` (null: dropless, the default) and `moe.token_drop_policy` (probs |
  position): megatron's expert capacity, capacity_factor x tokens x top-k / experts per
  expert; routed tokens beyond it are dropped (their expert output is zero). Megatron counts
  the capacity over each rank's tokens of each micro-batch, so WHICH tokens are dropped
  depends on the micro-batch cut, dp, cp and sequence parallelism: with a capacity factor
  the language-model loss is no longer layout-invariant (dropless, it is exact). The fraction
  dropped is logged as `moe/dropped_token_fraction`.
- `moe.grouped_experts` (default true): on the local (non Transformer Engine) layer spec the
  experts of a layer run as one grouped computation (models.layers.experts.grouped: torch._grouped_mm
  in bf16 on Hopper GPUs and on the CPU, one padded batched matmul elsewhere) instead of megatron's
  SequentialMLP loop over experts; the same parameters, checkpoint layout and numbers (fp32:
  within rounding). false: SequentialMLP.

- `moe.bias_update_rate` (default 0: off; sigmoid-routed families only: GLM-4.5,
  DeepSeek-V3): megatron's aux-loss-free load balancing (`moe_router_bias_update_rate`).
  After every optimizer step each MoE layer's score-correction bias (HF
  `e_score_correction_bias`, megatron `expert_bias`) moves by +rate for experts that got fewer
  than the average number of tokens and by -rate for those that got more. The tokens are
  counted over the whole global batch: every micro-batch of the step, summed over TP (sequence
  slices) x DP x CP; padding and the dummy sequences that even out micro-batch counts are left
  out (the engine passes megatron a padding mask), so the update, like the loss, does not
  depend on the layout. Off by default for fine-tuning: the published bias is the one the
  model was pre-trained with, the experts' balance over a small fine-tuning set is not the
  pre-training balance, and a bias drifting by +-rate per step would re-route tokens the
  checkpoint was never trained on; the load-balancing loss (moe.aux_loss_coeff) stays
  available either way. The bias is not a parameter: no gradient, no optimizer state; it is
  saved in checkpoints and exported as e_score_correction_bias.
- `moe.routing_replay` (RL only; null: off): `R2` records every token's top-k experts in the
  old-log-prob forward and replays them in every update forward of the step; `R3` replays the
  rollout engine's routing (prompt tokens: its prefill) in the old-log-prob and update
  passes. Replay forces only WHICH experts a token uses; the weights are recomputed from the
  current router (engine.training.routing, models.layers.experts.replay). Refused for dense models,
  with moe.capacity_factor (dropping would remove replayed assignments depending on the
  micro-batch cut), and for SFT; R3 needs a rollout backend that reports routed experts
  (engine.rl.policy.routing_replay).

Scaling (engine.training.router_losses): megatron attaches each micro-batch's router loss times its
local token count and expects a later division by the step's token count, which this engine
never does (engine.training.loss); the coefficients are therefore divided by the step's token count
before every step, so the step's router loss is coeff x the token-weighted mean of megatron's
per-micro-batch values. The language-model loss and gradient are unchanged by any of this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from models.families.registry import is_moe, moe_family

TOKEN_DISPATCHERS = ("alltoall", "allgather")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
ROUTING_REPLAY = ("R2", "R3")


@dataclass
class MoEConfig:
    token_dispatcher: str = "alltoall"   # alltoall | allgather (allgather: parallel.ep=1 only)
    aux_loss_coeff: Optional[float] = None  # null: HF router_aux_loss_coef if
    #                                         output_router_logits, else 0
    aux_loss_type: str = "aux_loss"      # aux_loss | seq_aux_loss | global_aux_loss
    z_loss_coeff: Optional[float] = None  # null/0: no router z-loss
    capacity_factor: Optional[float] = None  # null: dropless; > 0: drop tokens over capacity
    token_drop_policy: str = "probs"     # probs | position (which tokens an expert keeps)
    grouped_experts: bool = True         # one grouped expert computation (false: a loop)
    routing_replay: Optional[str] = None  # RL: null | R2 | R3 (engine.training.routing)
    bias_update_rate: float = 0.0        # aux-loss-free bias update per step (0: off)


def _is_moe(hf_config: dict) -> bool:
    return is_moe(hf_config)


def aux_loss_coeff(moe_cfg: MoEConfig, hf_config: dict) -> float:
    """moe.aux_loss_coeff resolved (null -> the HF config's rule; 0.0 for dense models)."""
    if not _is_moe(hf_config):
        return 0.0
    if moe_cfg.aux_loss_coeff is not None:
        return float(moe_cfg.aux_loss_coeff)
    if hf_config.get("output_router_logits"):
        return float(hf_config.get("router_aux_loss_coef") or 0.0)
    return 0.0


def moe_problems(cfg: Any, hf_config: dict) -> list[str]:
    """Every invalid moe.* value (and moe keys set for a dense model), naming the key."""
    moe = getattr(cfg, "moe", None) or MoEConfig()
    p: list[str] = []
    if moe.token_dispatcher not in TOKEN_DISPATCHERS:
        p.append(f"moe.token_dispatcher={moe.token_dispatcher!r} is not valid; choose one of "
                 f"{', '.join(TOKEN_DISPATCHERS)}")
    elif moe.token_dispatcher == "allgather" and cfg.parallel.ep > 1:
        p.append(f"moe.token_dispatcher=allgather needs parallel.ep=1 (got "
                 f"{cfg.parallel.ep}): it gathers the same number of tokens from every EP "
                 "rank, and data-parallel ranks run micro-batches of different lengths; use "
                 "alltoall")
    if moe.aux_loss_type not in AUX_LOSS_TYPES:
        p.append(f"moe.aux_loss_type={moe.aux_loss_type!r} is not valid; choose one of "
                 f"{', '.join(AUX_LOSS_TYPES)}")
    if moe.token_drop_policy not in DROP_POLICIES:
        p.append(f"moe.token_drop_policy={moe.token_drop_policy!r} is not valid; choose one of "
                 f"{', '.join(DROP_POLICIES)}")
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        value = getattr(moe, key)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0):
            p.append(f"moe.{key}={value!r} must be null or a number >= 0")
    if not isinstance(moe.grouped_experts, bool):
        p.append(f"moe.grouped_experts={moe.grouped_experts!r} must be true or false")
    cf = moe.capacity_factor
    if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
        p.append(f"moe.capacity_factor={cf!r} must be null (dropless) or a number > 0")
    p += _replay_problems(cfg, moe, hf_config)
    p += _bias_update_problems(moe, hf_config)
    if not _is_moe(hf_config):
        set_keys = [k for k in ("aux_loss_coeff", "z_loss_coeff", "capacity_factor")
                    if getattr(moe, k)]
        if set_keys:
            p.append(f"moe.{set_keys[0]} is set but model.hf_path is a dense model "
                     f"(model_type={hf_config.get('model_type')!r}); remove it")
    return p


def has_expert_bias(hf_config: dict) -> bool:
    """Whether the model's routers carry a score-correction bias (sigmoid routing)."""
    moe = moe_family(hf_config)
    return moe is not None and moe.expert_bias


def _bias_update_problems(moe: MoEConfig, hf_config: dict) -> list[str]:
    rate = moe.bias_update_rate
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate < 0:
        return [f"moe.bias_update_rate={rate!r} must be a number >= 0 (0: off)"]
    if rate > 0 and not has_expert_bias(hf_config):
        return [f"moe.bias_update_rate={rate} needs a model whose routers have a "
                "score-correction bias (sigmoid routing: glm4_moe, deepseek_v3); model_type="
                f"{hf_config.get('model_type')!r} has none; remove it"]
    return []


def _replay_problems(cfg: Any, moe: MoEConfig, hf_config: dict) -> list[str]:
    mode = moe.routing_replay
    if mode is None:
        return []
    if mode not in ROUTING_REPLAY:
        return [f"moe.routing_replay={mode!r} is not valid; choose one of null, "
                f"{', '.join(ROUTING_REPLAY)}"]
    if not hasattr(cfg, "rollout"):
        return [f"moe.routing_replay={mode} applies to RL only (python -m engine.rl); remove it"]
    if not _is_moe(hf_config):
        return [f"moe.routing_replay={mode} needs a MoE policy but model.hf_path is a dense "
                f"model (model_type={hf_config.get('model_type')!r}); remove it"]
    if moe.capacity_factor:
        return [f"moe.routing_replay={mode} cannot be combined with moe.capacity_factor="
                f"{moe.capacity_factor}: capacity dropping would remove replayed expert "
                "assignments depending on the micro-batch cut; use null (dropless)"]
    return []


def moe_overrides(cfg: Any, hf_config: dict, forward_only: bool = False) -> dict:
    """TransformerConfig fields of the moe.* keys (empty for dense models), and
    build_model_chunks' `grouped_experts`. The loss
    coefficients given here are the unscaled ones; engine.training.router_losses rescales them per
    step. `forward_only` (a frozen model, e.g. RL's KL reference): no router losses."""
    if not _is_moe(hf_config):
        return {}
    moe = getattr(cfg, "moe", None) or MoEConfig()
    coeff = 0.0 if forward_only else aux_loss_coeff(moe, hf_config)
    z_coeff = None if forward_only or not moe.z_loss_coeff else float(moe.z_loss_coeff)
    return dict(moe_token_dispatcher_type=moe.token_dispatcher,
                moe_router_load_balancing_type=moe.aux_loss_type if coeff > 0 else "none",
                moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff,
                moe_expert_capacity_factor=(float(moe.capacity_factor)
                                            if moe.capacity_factor else None),
                moe_token_drop_policy=moe.token_drop_policy,
                **({"moe_router_bias_update_rate": 0.0 if forward_only
                    else float(moe.bias_update_rate)} if has_expert_bias(hf_config) else {}),
                grouped_experts=moe.grouped_experts)  # a builder argument (models.build.factory)
