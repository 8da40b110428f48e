"""train.prefix_sharing: which models and settings share prefixes exactly, checked before any
process group exists (docs/prefix-sharing.md).

With sharing on, a micro-batch's rows run as one prefix tree (engine.training.tree_batch): each
token attends to its ancestors, takes its depth as its RoPE position, and every per-token output
is gathered back to the unshared rows before the loss. That is exact for decoder layers whose
token state depends only on the token's own row prefix through softmax attention with RoPE
positions. Everything else is refused here, by name:

- Gated DeltaNet hybrids (Qwen3.5/3.6): the recurrent state would have to fork at each branch;
- vision-language models: an image in a shared prefix (M-RoPE positions per image) is not handled;
- MLA (DeepSeek-V3, Kimi-K2), learned sinks and sliding windows (gpt-oss, Qwen2's
  use_sliding_window): their attention is not yet tree-aware;
- mixture-of-experts families: the router's auxiliary losses and expert-bias counts would count a
  shared token once instead of once per row, and routing replay records per model token;
- model.mtp.enabled (next-next-token targets differ per row at a branch);
- train.compile resolved on (a compiled layer would trace each tree's RoPE positions);
- context parallelism other than Ulysses (parallel.cp_comm_type a2a).
"""
from __future__ import annotations

from typing import Any

from engine.config.compile_settings import compile_on
from models.families.base import field

# model_type -> why it cannot share prefixes exactly (dense llama, qwen2, qwen3 can)
SHARING_FAMILIES = ("llama", "qwen2", "qwen3")
REFUSED_FAMILIES = {
    "qwen3_5": "a Gated DeltaNet hybrid (its recurrent state would have to fork at each branch)",
    "qwen3_5_moe": "a Gated DeltaNet hybrid (its recurrent state would have to fork at each "
                   "branch)",
    "qwen3_5_conditional": "a Gated DeltaNet hybrid with images",
    "qwen3_5_moe_conditional": "a Gated DeltaNet hybrid with images",
    "deepseek_v3": "multi-head latent attention (MLA) is not tree-aware yet",
    "kimi_k2": "multi-head latent attention (MLA) is not tree-aware yet",
    "gpt_oss": "learned attention sinks and sliding windows are not tree-aware yet",
}
MOE_REASON = ("a mixture-of-experts model (router auxiliary losses and expert-bias counts would "
              "count a shared token once, not once per row)")
VISION_REASON = "a vision-language model (images in a shared prefix are not handled)"


def _reason(hf_config: dict) -> str | None:
    """Why this model cannot share prefixes exactly, or None."""
    model_type = field(hf_config, "model_type")
    if model_type in REFUSED_FAMILIES:
        return REFUSED_FAMILIES[model_type]
    if "vl" in str(model_type).split("_") or "vision_config" in hf_config:
        return VISION_REASON
    if model_type not in SHARING_FAMILIES:
        return MOE_REASON if "moe" in str(model_type) or model_type in (
            "mixtral", "glm4_moe") else f"model_type {model_type!r} is not one of " \
            f"{', '.join(SHARING_FAMILIES)}"
    if hf_config.get("use_sliding_window"):
        return "use_sliding_window=true (sliding-window attention is not tree-aware yet)"
    return None


def prefix_sharing_problems(cfg: Any, hf_config: dict) -> list[str]:
    """Every reason train.prefix_sharing=true cannot be exact for this run (module docstring);
    [] when it is off."""
    if not getattr(cfg.train, "prefix_sharing", False):
        return []
    key = "train.prefix_sharing=true"
    problems = []
    reason = _reason(hf_config)
    if reason:
        problems.append(f"{key} is not supported for model.hf_path={cfg.model.hf_path}: "
                        f"{reason}; supported: dense {', '.join(SHARING_FAMILIES)} models")
    mtp = getattr(getattr(cfg.model, "mtp", None), "enabled", False)
    if mtp:
        problems.append(f"{key} with model.mtp.enabled=true: the next-next-token targets differ "
                        "per row at a branch; turn one of them off")
    try:
        compiled = compile_on(cfg.train)
    except ValueError:   # an invalid train.compile: compile_problems names it
        compiled = False
    if compiled:
        problems.append(f"{key} with train.compile on: compiled layers would trace each tree's "
                        "positions; set train.compile=false")
    if cfg.parallel.cp > 1 and cfg.parallel.cp_comm_type != "a2a":
        problems.append(f"{key} with parallel.cp={cfg.parallel.cp} and parallel.cp_comm_type="
                        f"{cfg.parallel.cp_comm_type}: the tree attention runs in Ulysses (a2a) "
                        "context parallelism only")
    return problems
