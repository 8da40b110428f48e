"""Where each HF checkpoint tensor lives inside a loaded transformers model.

The weight sync streams tensors under their checkpoint names (models.bridge.export_hf_weights:
what `save_pretrained` writes and SGLang loads). transformers >= 5 keeps the experts of a
mixture-of-experts layer fused in memory: `...mlp.experts.gate_up_proj` [E, 2 I, H] (expert
e's gate_proj rows, then its up_proj rows) and `...mlp.experts.down_proj` [E, H, I], while the
checkpoint holds `...mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H] and
`down_proj` [H, I] per expert. `checkpoint_targets` maps every checkpoint name to the tensor
(a parameter, or a view of a fused one) that receives it; older transformers keep one module
per expert and need no view.
"""
from __future__ import annotations

import torch

_FUSED_SUFFIX = ".experts.gate_up_proj"


def _expert_views(prefix: str, gate_up: torch.Tensor, down: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Checkpoint name -> view for the fused experts under `prefix` (ends in '.experts')."""
    num_experts, two_i, _ = gate_up.shape
    if two_i % 2 or down.ndim != 3 or down.shape[0] != num_experts:
        raise ValueError(f"{prefix}: fused expert shapes {tuple(gate_up.shape)} and "
                         f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
    i = two_i // 2
    out = {}
    for e in range(num_experts):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :i]
        out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, i:]
        out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out


def checkpoint_targets(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, str]]:
    """(checkpoint name -> tensor to copy into, checkpoint name -> canonical name).

    Canonical names identify what must be written after a wake: tied aliases (e.g.
    lm_head.weight with tied embeddings) share their first name; each expert view is its
    own."""
    params = dict(model.named_parameters(remove_duplicate=False))
    first = {id(p): name for name, p in reversed(list(params.items()))}
    targets: dict[str, torch.Tensor] = {}
    canonical: dict[str, str] = {}
    for name, param in params.items():
        if name.endswith(_FUSED_SUFFIX) and param.ndim == 3:
            prefix = name[: -len(".gate_up_proj")]
            views = _expert_views(prefix, param, params[prefix + ".down_proj"])
            targets.update(views)
            canonical.update({n: n for n in views})
        elif name.endswith(".experts.down_proj") and param.ndim == 3 and (
                name[: -len(".down_proj")] + ".gate_up_proj") in params:
            continue  # covered by its gate_up_proj's views
        else:
            targets[name] = param
            canonical[name] = first[id(param)]
    return targets, canonical
