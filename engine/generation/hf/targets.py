"""Where each HF checkpoint tensor lives inside a loaded transformers model.

The weight sync streams tensors under their checkpoint names (models.bridge.weights.export_hf_weights:
what `save_pretrained` writes and SGLang loads). transformers >= 5 keeps the experts of a
mixture-of-experts layer fused in memory, under `model.layers.{i}.mlp` whatever the family
calls the block on disk: `...mlp.experts.gate_up_proj` [E, 2 I, H] (expert e's gate rows,
then its up rows), `...mlp.experts.down_proj` [E, H, I] and the router `...mlp.gate.weight`
[E, H], while the checkpoint holds one tensor per expert and projection named by the family's
ExpertNaming (models.families.moe): Qwen3-MoE `mlp.experts.{e}.{gate,up,down}_proj.weight`
and `mlp.gate.weight`, Mixtral `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` and
`block_sparse_moe.gate.weight`. `checkpoint_targets` maps every checkpoint name to the tensor
(a parameter, or a view of a fused one) that receives it; older transformers keep one module
per expert under the checkpoint's names and need no view. gpt-oss checkpoints are fused as
in memory (`fused_experts_on_disk`: models.layers.biased_experts.fused): every name is its parameter
(Qwen3-VL-MoE's `fused_experts_transposed_in_memory`: a transposed view of it).
"""
from __future__ import annotations

import torch

from models.families.moe import ExpertNaming
from models.families.registry import expert_naming, moe_family

_FUSED_SUFFIX = "mlp.experts.gate_up_proj"
_ROUTER_SUFFIX = "mlp.gate.weight"
_SCORE_BIAS = "e_score_correction_bias"  # sigmoid routers (models.families.sigmoid_routed)
# Names of a MoE model whose model_type the bridge does not know (transformers' default).
_DEFAULT_NAMING = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def _expert_views(head: str, gate_up: torch.Tensor, down: torch.Tensor, naming: ExpertNaming
                  ) -> dict[str, torch.Tensor]:
    """Checkpoint name -> view for the fused experts of the layer named `head`
    ("model.layers.{i}.")."""
    num_experts, two_i, _ = gate_up.shape
    if two_i % 2 or down.ndim != 3 or down.shape[0] != num_experts:
        raise ValueError(f"{head}{_FUSED_SUFFIX}: fused expert shapes {tuple(gate_up.shape)} "
                         f"and {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
    i = two_i // 2
    out = {}
    for e in range(num_experts):
        out[head + naming.expert(e, "gate")] = gate_up[e, :i]
        out[head + naming.expert(e, "up")] = gate_up[e, i:]
        out[head + naming.expert(e, "down")] = down[e]
    return out


def checkpoint_targets(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, str]]:
    """(checkpoint name -> tensor to copy into, checkpoint name -> canonical name).

    Canonical names identify what must be written after a wake: tied aliases (e.g.
    lm_head.weight with tied embeddings) share their first name; each expert view is its
    own; a renamed router is its checkpoint name. The routers' e_score_correction_bias
    buffers (GLM-4.5, DeepSeek-V3) are targets too."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()   # a conditional-generation model's text model
    naming = expert_naming(config) or _DEFAULT_NAMING
    family = moe_family(config)
    fused_on_disk = family is not None and family.fused_experts_on_disk
    transposed = fused_on_disk and family.fused_experts_transposed_in_memory
    params = dict(model.named_parameters(remove_duplicate=False))
    first = {id(p): name for name, p in reversed(list(params.items()))}
    targets: dict[str, torch.Tensor] = {}
    canonical: dict[str, str] = {}
    for name, param in params.items():
        if fused_on_disk:  # the checkpoint's names are the parameters' (gpt-oss)
            # Qwen3-VL-MoE holds gate_up_proj / down_proj transposed: written through a view
            fused = transposed and name.endswith(("mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"))
            targets[name] = param.transpose(1, 2) if fused else param
            canonical[name] = first[id(param)]
        elif name.endswith(_FUSED_SUFFIX) and param.ndim == 3:
            head = name[: -len(_FUSED_SUFFIX)]
            views = _expert_views(head, param, params[head + "mlp.experts.down_proj"], naming)
            targets.update(views)
            canonical.update({n: n for n in views})
        elif name.endswith("mlp.experts.down_proj") and param.ndim == 3 and (
                name[: -len("down_proj")] + "gate_up_proj") in params:
            continue  # covered by its gate_up_proj's views
        elif name.endswith("." + _ROUTER_SUFFIX) and (
                name[: -len(_ROUTER_SUFFIX)] + _FUSED_SUFFIX) in params:
            checkpoint = name[: -len(_ROUTER_SUFFIX)] + naming.router
            targets[checkpoint] = param
            canonical[checkpoint] = checkpoint
        else:
            targets[name] = param
            canonical[name] = first[id(param)]
    for name, buffer in model.named_buffers():  # sigmoid routers' bias: an HF buffer
        if name.endswith("." + _SCORE_BIAS):
            targets[name] = buffer
            canonical[name] = name
    return targets, canonical
