"""LoRA in the memory estimate of `--validate` (models.estimate.training_memory.estimate_memory,
used by SFT and RL; docs/lora.md#memory).

With adapters (model.lora.rank > 0) the base model is frozen: its parameters are held in
model.dtype (a bytes each) with no gradient buffer and no optimizer state; only the adapters
(models.estimate.lora.adapter_parameters: this TP rank's share of its pipeline stage) are
trained. Per GPU, N the stage's base parameters and n its adapter parameters (n_e of them
expert adapters):

- weights: (N + n) x a bytes (the adapters in model.dtype, like the linears they sit on);
- grads: n x 4 bytes (megatron DDP's fp32 gradient buffer covers trainable parameters only);
- optimizer: (n - n_e) x the per-parameter optimizer bytes + n_e x the expert ones (fp32 master
  copy and Adam m, v in bf16: 12 bytes, sharded over dp x cp with the distributed optimizer;
  expert adapters over the expert-data-parallel group, as experts);
- activations: full fine-tuning's (a trainable linear keeps its input for the weight
  gradient; a frozen one does not, and its adapter keeps the same tensor, on the sequence
  shard under sequence parallelism) plus, per layer and token, the adapters' own: the rank-r
  activation of each adapted projection that B's gradient needs (r per column slice, gathered
  over the sequence; r / s per row slice, s = tp with sequence parallelism: B sees this rank's
  sequence shard; experts: the ranks of gate_up_proj's and down_proj's adapters per routed
  copy (3 r after peft's conversion of gate/up/down), k copies per token). No gathered input:
  a column adapter gathers A x, not x (models.lora.adapters). model.lora.dropout > 0 would add
  a dropped copy of each adapted input: not counted (the exact mode is dropout 0).
"""
from __future__ import annotations

from dataclasses import replace

from models.families.registry import family_of, moe_family
from models.estimate.lora import adapter_parameters
from models.lora.targets import EXPERT_TARGETS, PARAMETER_TARGETS

GIB = 2 ** 30
_QKV = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def adapter_activation_bytes(hf: dict, lora, a: int, t: float, s: int) -> float:
    """Bytes the adapters add to one layer's kept activations for `t` tokens per rank (module
    docstring); 0 without LoRA (`lora` a models.lora.adapters.LoraSpec or None)."""
    if lora is None:
        return 0.0
    targets, r = lora.targets, lora.rank
    moe = moe_family(hf)
    column = sum(n in targets for n in _QKV)
    row = "o_proj" in targets
    routed = 0   # per token: the rank of each routed copy's expert adapters (k copies)
    if moe is None:
        column += sum(n in targets for n in _MLP[:2])
        row += "down_proj" in targets
    else:   # layer 0's keys stand for every layer's (a rank is the same in every layer)
        routed = moe.experts_per_token(hf) * sum(
            lora.rank_of(f"model.layers.0.mlp.{t}") for t in EXPERT_TARGETS if t in targets)
    return a * t * (r * column + r * row / s + routed)


def with_adapters(est, base: int, hf: dict, layout, lora, a: int, opt_bytes: float,
                  expert_opt_bytes: float, last: bool):
    """`est` (a MemoryEstimate of full fine-tuning of `base` parameters per rank on the first
    pipeline stage, or the last with `last`) with the module docstring's weights, grads and
    optimizer of the frozen base plus adapters; notes gain adapter_parameters and
    base_parameters (this rank's)."""
    count = adapter_parameters(hf, lora.targets, lora, layout.tp, layout.pp, layout.ep)
    n = count.last_stage if last else count.first_stage
    experts = count.expert_last if last else count.expert_first
    return replace(est, weights=(base + n) * a / GIB, grads=n * 4 / GIB,
                   optimizer=((n - experts) * opt_bytes + experts * expert_opt_bytes) / GIB,
                   notes={**est.notes, "adapter_parameters": n, "base_parameters": base})


def lora_summary(hf: dict, lora, total_parameters: int) -> list[str]:
    """The --validate line of model.lora.* ([] without LoRA): the targets that adapt a linear
    of this model, the adapter count (unsharded) and its share of the model."""
    if lora is None:
        return []
    n = adapter_parameters(hf, lora.targets, lora, 1, 1).total
    known = set(family_of(hf).lora_targets) | set(PARAMETER_TARGETS)   # the family's names
    adapted = [t for t in sorted(lora.targets & known)
               if adapter_parameters(hf, frozenset({t}), lora, 1, 1).total]
    idle = sorted(set(lora.targets) & known - set(adapted))
    return [f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(adapted)}"
            + (f" ({', '.join(idle)}: no such linear in this model's MoE layers, as in peft)"
               if idle else "")
            + f": {n / 1e6:.1f} M adapter parameters trained ({100 * n / total_parameters:.2f}"
            " % of the model); the base is frozen (no gradients, no optimizer state)"]
