"""train.prefix_sharing: which models and settings share prefixes exactly, checked before any
process group exists (docs/prefix-sharing.md).

With sharing on, a micro-batch's rows run as one prefix tree (engine.training.tree_batch): each
token attends to its ancestors, takes its depth as its RoPE position, and every per-token output
is gathered back to the unshared rows before the loss. That is exact for decoder layers whose
token state depends only on the token's own row prefix through softmax attention with RoPE
positions. Everything else is refused here, by name:

Mixture-of-experts families share: each token's routing and expert outputs depend on its own
hidden state only, so the log-probs, the loss and its gradient are exact (EP2 tested). The
router's auxiliary losses (moe.aux_loss_coeff, moe.z_loss_coeff) and the moe/* metrics are
treated like packing (engine.training.router_losses): megatron computes them per micro-batch
over the token positions the model runs, so a shared token counts once, as a packed micro-batch
already changes them with micro-batch size, dp and pp. They are therefore not equal to the
unshared run's; with both coefficients 0 (the default of families whose HF config does not
train them) the step is exact. Routing replay (moe.routing_replay R2/R3) shares too: a node
records its choice for every row token it stands for, and with routed experts to replay the
trie is keyed by (token, recorded routing), so rows share a node only where their recorded
routings agree (engine.training.tree_routing).

Learned attention sinks and sliding windows (gpt-oss; Qwen2's use_sliding_window, whose
sliding layers the model checks refuse anyway) share: the tree attention applies the layer's
sinks and counts its window along each token's own row (parallel.tree_attention_sinks).
Multi-latent attention (DeepSeek-V3, Kimi-K2) shares: its RoPE reaches the same thd rotary,
which takes each token's depth (models.layers.attention.packed_rope), and the tree attention
takes its value head dim (parallel.tree_attention_split pads it to the query's on the CPU).

- Gated DeltaNet hybrids (Qwen3.5/3.6): the recurrent state would have to fork at each branch;
- vision-language models: an image in a shared prefix (M-RoPE positions per image) is not handled;
- with a mixture-of-experts model: moe.bias_update_rate > 0 (the expert-bias update counts the
  tokens routed) and moe.capacity_factor (which tokens are dropped depends on the tokens that
  share the micro-batch);
- model.mtp.enabled (next-next-token targets differ per row at a branch);
- context parallelism other than Ulysses (parallel.cp_comm_type a2a).

train.compile shares: a tree row is a packed ("thd") row, whose RoPE (each token's depth,
`tree_positions`) and tree attention run eagerly outside the compiled regions; these see only
its [tokens, hidden] activations, so no tree compiles anything new (models.build.compile_layers).
"""
from __future__ import annotations

from typing import Any

from models.families.base import field
from models.families.registry import FAMILIES, is_moe

HYBRID_REASON = "a Gated DeltaNet hybrid (its recurrent state would have to fork at each branch)"
VISION_REASON = "a vision-language model (images in a shared prefix are not handled)"


def _reason(hf_config: dict) -> str | None:
    """Why this model cannot share prefixes exactly, or None: read from the family's declared
    facts (models.families.base.Family), never from its model_type. An unknown model_type is
    left to the model checks, which name it."""
    wrapper = FAMILIES.get(field(hf_config, "model_type"))
    if wrapper is None:
        return None
    # a conditional-generation wrapper trains its text model: both families' facts count
    fams = [f for f in (wrapper, FAMILIES.get(wrapper.text_model_type)) if f is not None]
    refused = [f.prefix_sharing_refused for f in fams if f.prefix_sharing_refused]
    if refused:
        return refused[0]
    if any(f.hybrid for f in fams):
        return HYBRID_REASON
    if (any(f.vision_prefix for f in fams) or "vision_config" in hf_config
            or "vl" in str(field(hf_config, "model_type")).split("_")):
        return VISION_REASON
    return None


def _moe_problems(cfg: Any, key: str) -> list[str]:
    """The moe.* settings that count routed tokens or drop them (module docstring)."""
    moe = getattr(cfg, "moe", None)
    if moe is None:
        return []
    problems = []
    rate = getattr(moe, "bias_update_rate", 0.0)
    if isinstance(rate, (int, float)) and rate > 0:
        problems.append(f"{key} with moe.bias_update_rate={rate}: the expert-bias update "
                        "counts routed tokens, and a shared token would count once instead of "
                        "once per row; set moe.bias_update_rate=0 or train.prefix_sharing=false")
    cf = getattr(moe, "capacity_factor", None)
    if cf:
        problems.append(f"{key} with moe.capacity_factor={cf}: which tokens are dropped "
                        "depends on the tokens sharing the micro-batch; set "
                        "moe.capacity_factor=null (dropless) or train.prefix_sharing=false")
    return problems


SHARING_CHOICES = ("auto", "true", "false")


def sharing_choice(value: Any) -> str | None:
    """train.prefix_sharing's choice: "auto" (also null), "true" or "false" (booleans and
    YAML's yes/no read as such); None when `value` is none of them."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    word = str(value).strip().lower()
    word = {"yes": "true", "on": "true", "no": "false", "off": "false", "null": "auto",
            "none": "auto"}.get(word, word)
    return word if word in SHARING_CHOICES else None


def sharing_requested(train: Any) -> bool:
    """train.prefix_sharing is explicitly true (SFT's boolean key or RL's choice)."""
    return sharing_choice(getattr(train, "prefix_sharing", False)) == "true"


def prefix_sharing_problems(cfg: Any, hf_config: dict, force: bool = False) -> list[str]:
    """Every reason train.prefix_sharing=true cannot be exact for this run (module docstring);
    [] when it is not explicitly true (RL's `auto` is resolved by
    engine.config.micro_batch_defaults, which asks with `force`: the reasons sharing would
    have)."""
    value = getattr(cfg.train, "prefix_sharing", False)
    if sharing_choice(value) is None:
        return [f"train.prefix_sharing={value!r} is not one of {list(SHARING_CHOICES)}"]
    if not force and not sharing_requested(cfg.train):
        return []
    key = "train.prefix_sharing=true"
    problems = []
    reason = _reason(hf_config)
    if reason:
        problems.append(f"{key} is not supported for model.hf_path={cfg.model.hf_path}: "
                        f"{reason}; supported: dense text-only decoders with softmax attention "
                        "(Llama, Qwen2, Qwen3) and mixture-of-experts ones (Qwen3-MoE, Mixtral, "
                        "gpt-oss, DeepSeek-V3 and Kimi-K2 with MLA)")
    if is_moe(hf_config):
        problems += _moe_problems(cfg, key)
    mtp = getattr(getattr(cfg.model, "mtp", None), "enabled", False)
    if mtp:
        problems.append(f"{key} with model.mtp.enabled=true: the next-next-token targets differ "
                        "per row at a branch; turn one of them off")
    if cfg.parallel.cp > 1 and cfg.parallel.cp_comm_type != "a2a":
        problems.append(f"{key} with parallel.cp={cfg.parallel.cp} and parallel.cp_comm_type="
                        f"{cfg.parallel.cp_comm_type}: the tree attention runs in Ulysses (a2a) "
                        "context parallelism only")
    return problems
