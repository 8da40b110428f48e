"""What every mixture-of-experts family shares: the HF names of its router and experts
(`ExpertNaming`, the per-family hook models.layers.experts.mapping, counting and the RL weight sync
read) and the `MoeFamily` base (layer tensors, megatron MoE kwargs, common field rows).

Every decoder layer of a MoE family here is sparse: a linear router (no bias) over
`num_experts` SwiGLU experts, softmax over all experts, top-k, with or without
renormalisation of the k weights (`MoeFamily.renormalises`). Megatron mapping:
`num_moe_experts`, `moe_router_topk`, `moe_ffn_hidden_size`, softmax score function; HF's
"softmax over all experts, top-k, renormalise" is megatron's `moe_router_pre_softmax=False`
(top-k of the logits, softmax over those k: the same numbers), without renormalisation
`moe_router_pre_softmax=True` (softmax over all, then top-k). No token dropping (HF never
drops), no expert bias, no shared expert.

Plain Python (no torch, megatron or transformers), like models.families.base.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.families.base import Family, FieldRule, field

# Megatron's fused fc1 holds [gate; up] per expert-TP rank; fc2 is the down projection.
PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertNaming:
    """HF checkpoint names of one MoE layer (suffixes under `model.layers.{i}.`).

    `block`: the MoE module on disk ("mlp" for Qwen3-MoE, "block_sparse_moe" for Mixtral);
    the router is `{block}.gate.weight` [E, H]; expert e's projections are
    `{block}.experts.{e}.{proj}.weight` with `proj` = gate [I, H], up [I, H], down [H, I]
    spelled by `gate` / `up` / `down` (e.g. gate_proj or w1). transformers >= 5 holds the
    same weights under `mlp.gate.weight` and fused `mlp.experts.gate_up_proj` [E, 2I, H] /
    `mlp.experts.down_proj` [E, H, I] whatever `block` is (engine.generation.hf.targets)."""

    block: str
    gate: str
    up: str
    down: str
    router_module: str = "gate"  # the router is `{block}.{router_module}` (gpt-oss: router)

    @property
    def router(self) -> str:
        return f"{self.block}.{self.router_module}.weight"

    @property
    def router_bias(self) -> str:
        """The router's bias (families whose router has one: gpt-oss)."""
        return f"{self.block}.{self.router_module}.bias"

    def expert_bias(self, e: int, projection: str) -> str:
        """Suffix of expert e's `projection` bias (families with expert biases: gpt-oss)."""
        return f"{self.block}.experts.{e}.{getattr(self, projection)}.bias"

    def expert(self, e: int, projection: str) -> str:
        """Suffix of expert e's `projection` (one of PROJECTIONS) weight."""
        return f"{self.block}.experts.{e}.{getattr(self, projection)}.weight"

    def layer_tensors(self, num_experts: int) -> tuple[str, ...]:
        """The router and every expert weight of one layer, experts in order."""
        return (self.router,) + tuple(self.expert(e, p) for e in range(num_experts)
                                      for p in PROJECTIONS)


def _count(cfg: Any) -> int:
    """Experts per layer: `num_experts` or `num_local_experts` (transformers maps one onto
    the other for Qwen3-MoE and Mixtral configs; config.json may use either)."""
    return int(field(cfg, "num_experts", field(cfg, "num_local_experts", 0)))


def _num_experts(cfg: Any) -> str | None:
    if _count(cfg) >= 1:
        return None
    return f"num_experts={_count(cfg)} is not supported (no sparse layer); supported: >= 1"


def _top_k(cfg: Any) -> str | None:
    k, e = int(field(cfg, "num_experts_per_tok", 0)), _count(cfg)
    if 1 <= k <= max(e, 1):
        return None
    return f"num_experts_per_tok={k} is not supported; supported: 1..num_experts={e}"


def _router_jitter(cfg: Any) -> str | None:
    noise = float(field(cfg, "router_jitter_noise", 0.0))
    if noise == 0.0:
        return None
    return (f"router_jitter_noise={noise!r} is not supported (HF multiplies the router input "
            "by random noise in training); supported: 0.0")


NUM_EXPERTS = FieldRule("num_experts (num_local_experts)", ">= 1 -> num_moe_experts",
                        _num_experts)
TOP_K = FieldRule("num_experts_per_tok", "1..num_experts -> moe_router_topk", _top_k)
ROUTER_JITTER = FieldRule("router_jitter_noise", "0.0; refused: anything else", _router_jitter)
AUX_LOSS = FieldRule("router_aux_loss_coef / output_router_logits", "training only: the "
                     "default of moe.aux_loss_coeff is router_aux_loss_coef when "
                     "output_router_logits is true (HF adds the loss only then), else 0 "
                     "(engine.config.moe_settings)")
MOE_FIELDS = (NUM_EXPERTS, TOP_K, ROUTER_JITTER, AUX_LOSS)


def _dense_layers(cfg: Any) -> list[int]:
    """Layers HF builds with a dense MLP instead of experts (decoder_sparse_step,
    mlp_only_layers), as Qwen3MoeDecoderLayer decides."""
    step = int(field(cfg, "decoder_sparse_step", 1))
    only = set(field(cfg, "mlp_only_layers", []) or [])
    layers = int(field(cfg, "num_hidden_layers"))
    return [i for i in range(layers) if i in only or step < 1 or (i + 1) % step != 0]


def _sparse_layers(cfg: Any) -> str | None:
    dense = _dense_layers(cfg)
    if not dense:
        return None
    return (f"decoder_sparse_step={field(cfg, 'decoder_sparse_step', 1)!r} with "
            f"mlp_only_layers={list(field(cfg, 'mlp_only_layers', []) or [])!r} gives layers "
            f"{dense} a dense MLP; the bridge maps only all-sparse models; supported: "
            "decoder_sparse_step=1 and mlp_only_layers=[]")


# Qwen3-MoE and Qwen3-VL-MoE: HF builds a dense MLP in some layers by these two fields
ALL_SPARSE = FieldRule("decoder_sparse_step / mlp_only_layers", "every layer sparse (step 1, "
                       "no mlp_only_layers) -> an MoE layer everywhere; refused: dense layers",
                       _sparse_layers)


# peft 0.21's conversion of target_modules names on transformers 5 models with fused experts
# (peft.utils.transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING): the conversion
# pattern "qwen2_moe" (model_types qwen3_moe, glm4_moe, deepseek_v3) and "mixtral"
# (Family.lora_fused; tests/test_lora.py checks them against peft)
PEFT_QWEN2_MOE = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"}
PEFT_MIXTRAL = {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj",
                "w2": "down_proj"}


class MoeFamily(Family):
    """A family whose every decoder layer is a sparse MoE block. Subclasses set `experts`
    (their ExpertNaming), `expert_width_field` and `renormalise_field`."""

    experts: ExpertNaming
    expert_width_field: str = "moe_intermediate_size"  # config field of each expert's width
    # config field that switches top-k renormalisation (default off when absent); None: the
    # architecture always renormalises (no field)
    renormalise_field: str | None = None

    def num_experts(self, cfg: Any) -> int:
        return _count(cfg)

    def experts_per_token(self, cfg: Any) -> int:
        return int(field(cfg, "num_experts_per_tok"))

    def expert_width(self, cfg: Any) -> int:
        """Intermediate width I of one expert's SwiGLU."""
        return int(field(cfg, self.expert_width_field))

    def renormalises(self, cfg: Any) -> bool:
        """Whether HF rescales the k selected softmax weights to sum to 1."""
        if self.renormalise_field is None:
            return True
        return bool(field(cfg, self.renormalise_field, False))

    # Declared facts (defaults: softmax routing, the same layer everywhere, per-expert tensors).
    # The router and every expert projection carry a bias (models.layers.biased_experts.spec)
    expert_biases: bool = False
    # Dense layers first, MoE after them (models.layers.sigmoid_routing.spec builds per layer)
    heterogeneous: bool = False
    # The routers carry a score-correction bias used for the top-k choice only (megatron
    # expert_bias; the aux-loss-free bias update)
    expert_bias: bool = False
    # gpt-oss, Qwen3-VL-MoE: the checkpoint holds each layer's experts as fused tensors
    # (gate_up_proj [E, H, 2I], down_proj [E, I, H]), which models.layers.biased_experts.fused
    # presents to the bridge as the per-expert `experts` names
    fused_experts_on_disk: bool = False
    # how gate and up share gate_up_proj's 2I columns on disk: "interleaved" (gpt-oss: gate
    # unit j at column 2j, up at 2j + 1) or "concatenated" (Qwen3-VL-MoE: gate, then up)
    fused_expert_layout: str = "interleaved"
    # transformers holds the fused tensors transposed from disk ([E, 2I, H], [E, H, I]:
    # Qwen3-VL-MoE); the HF rollout engine writes them through transposed views
    fused_experts_transposed_in_memory: bool = False

    def expert_parameters(self, cfg: Any) -> int:
        """Parameters of one routed expert (counting): its SwiGLU matrices."""
        return 3 * int(field(cfg, "hidden_size")) * self.expert_width(cfg)

    def is_moe_layer(self, cfg: Any, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has experts (True: every layer)."""
        return True

    def shared_expert_width(self, cfg: Any) -> int:
        """Intermediate width of a MoE layer's shared expert(s), 0 when none (counting)."""
        return 0

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        dense_mlp = {f"mlp.{p}_proj.weight" for p in PROJECTIONS}
        names = [n for n in super().layer_tensors(cfg) if n not in dense_mlp]
        return tuple(names) + self.experts.layer_tensors(self.num_experts(cfg))

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        kwargs.update(
            num_moe_experts=self.num_experts(cfg),
            moe_router_topk=self.experts_per_token(cfg),
            moe_ffn_hidden_size=self.expert_width(cfg),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.renormalises(cfg),
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",  # engine.config.moe_settings: moe.token_dispatcher
        )
        return kwargs
