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
from models.families.registry import FAMILIES, is_moe

HYBRID_REASON = "a Gated DeltaNet hybrid (its recurrent state would have to fork at each branch)"
MLA_REASON = "multi-head latent attention (MLA) is not tree-aware yet"
MOE_REASON = ("a mixture-of-experts model (router auxiliary losses and expert-bias counts would "
              "count a shared token once, not once per row)")
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
    if any(f.multi_latent_attention for f in fams):
        return MLA_REASON
    if is_moe(hf_config):
        return MOE_REASON
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
                        f"{reason}; supported: dense text-only decoders with softmax attention "
                        "(Llama, Qwen2, Qwen3)")
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
