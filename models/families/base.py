"""What a model family declares for the bridge, and the errors for models it cannot convert.

A family (one file per HF architecture under models/families/) is the single home of: its HF
`model_type` and class, its config-field table (every field that changes the math, mapped
exactly or refused), its Megatron `TransformerConfig` kwargs, the HF tensors of one layer, and
its preset shapes. Parameter counts follow from these (models.estimate.counting).

Plain Python and torch only: engine.config.schema imports the presets at start-up, so neither
megatron nor transformers is imported here. Field checks receive a transformers config object
(models.hf.config.hf_config_object); shape and bias helpers accept a dict as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn.functional as F


class UnsupportedModelError(ValueError):
    """An HF model this bridge cannot convert exactly (base of the three errors below)."""


class UnsupportedArchitectureError(UnsupportedModelError):
    """The HF config names an architecture (model_type) this bridge does not convert."""


class UnsupportedConfigError(UnsupportedModelError):
    """An HF config field has a value the bridge cannot map exactly."""


class UnmappedTensorsError(UnsupportedModelError):
    """The HF checkpoint holds tensors the mapping would not consume, or lacks some it needs."""


def field(cfg: Any, name: str, default: Any = None) -> Any:
    """`cfg[name]` of a config.json dict or `cfg.name` of a transformers config (None -> default)."""
    value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    return default if value is None else value


# The key under which a conditional-generation wrapper's own config.json dict rides in the
# text-model view the engines read (models.hf.conditional.text_view; never written out).
ORIGINAL = "_conditional_generation_config"


def original_config(config: Any) -> dict | None:
    """The wrapper config.json a view was made from (a dict or a transformers config object);
    None for a plain text model's config."""
    value = config.get(ORIGINAL) if isinstance(config, dict) else getattr(config, ORIGINAL, None)
    return value if isinstance(value, dict) else None


def wrapper_view(wrapper: dict, text_model_type: str) -> dict:
    """The config dict the engines read for a conditional-generation wrapper's config.json
    (models.hf.conditional.text_view): its `text_config` as model_type `text_model_type`, the
    wrapper's `tie_word_embeddings` (transformers' ForConditionalGeneration ties by it) and the
    wrapper itself under ORIGINAL. A missing text_config gives a view with no text fields."""
    text = wrapper.get("text_config")
    view = dict(text) if isinstance(text, dict) else {}
    view["model_type"] = text_model_type
    view["tie_word_embeddings"] = bool(wrapper.get("tie_word_embeddings", False))
    view[ORIGINAL] = wrapper
    return view


def head_dim(cfg: Any) -> int:
    """Per-head width: `head_dim` when set, else hidden_size // num_attention_heads (as HF)."""
    return field(cfg, "head_dim") or field(cfg, "hidden_size") // field(cfg, "num_attention_heads")


@dataclass(frozen=True)
class FieldRule:
    """One row of a family's config-field table.

    `field`: the HF config field(s) as a user writes them; `supported`: the values that map and
    what they map to; `problem(config)`: None when the value maps exactly, else one sentence
    naming the field, its value and what is supported (None itself: every value maps)."""

    field: str
    supported: str
    problem: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias: fused q/k/v, the attention output o_proj, the MLP."""

    qkv: bool = False
    o_proj: bool = False
    mlp: bool = False


ACTIVATIONS: dict[str, Callable] = {  # HF hidden_act -> the same function in torch
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# Suffixes under model.layers.{i}. that every family here has.
BASE_LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


class Family:
    """A decoder-only HF architecture the bridge converts. Subclass, set the class attributes,
    override `biases` (and `qk_norm`) where the family differs, and `register` an instance."""

    model_type: str = ""
    hf_class: str = ""
    qk_norm: bool = False                  # RMSNorm on each head of q and k (Qwen3)
    fields: tuple[FieldRule, ...] = ()     # the config-field table
    presets: dict[str, dict] = {}          # model.shape name -> public config.json values
    # Declared facts. The builders, the bridge, the estimators and the rollout read these
    # instead of branching on model_type; the defaults describe a plain GQA decoder.
    hybrid: bool = False                   # per-layer mixers by `mixer_of` (local spec only)
    multi_latent_attention: bool = False   # every layer's attention is MLA (models.layers.mla)
    lora: bool = False                     # LoRA adapters are built (models.lora.sites)
    # model.lora.target_modules names refused for this family: {name: why} (all-linear too)
    lora_refused: dict = {}
    # the projection names (peft's) of this family's nn.Linear modules that have adapter sites
    # (models.lora.sites); all-linear's modules (`lora_linear`); experts, router are apart
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj")
    # peft 0.21's conversion of target_modules names on this family with transformers 5
    # (peft's _MOE_TARGET_MODULE_MAPPING of the model_type's conversion pattern): {name: the
    # fused parameter it becomes (gate_up_proj, down_proj, gate.weight)}; None: peft reads
    # every name as a module (models.lora.targets)
    lora_fused: dict | None = None
    # HF paths in a decoder layer where this family's differ from models.lora.sites' defaults
    # (mlp.shared_expert, mlp.gate): {default: this family's}, for adapter names and keys
    lora_hf_paths: dict = {}
    # vLLM's model module for this architecture imports transformers' image processors, which
    # import torchvision (engine.generation.vllm.settings refuses vLLM where it cannot import)
    vllm_imports_torchvision: bool = False
    # the resolved LoRA targets (models.lora.targets) vLLM 0.32's LoRA serves on this family
    # (engine.generation.vllm.lora: rollout.vllm.lora_sync=adapter); empty: none, adapters reach
    # vLLM as merged weights
    vllm_lora_targets: tuple = ()
    text_model_type: str | None = None     # a conditional-generation wrapper's entry: read as
    #                                        this text model's config (models.hf.conditional)
    # where a conditional-generation checkpoint of this family stores its vision tower
    # (transformers' module, run in the trainer: models.vision); None: no images
    vision_prefix: str | None = None
    # why a prefix tree (train.prefix_sharing) is not exact for this family beyond what the facts
    # above say (hybrid, multi_latent_attention, vision_prefix, experts); None: nothing more
    prefix_sharing_refused: str | None = None

    def lora_linear(self, cfg: Any) -> tuple:
        """The projection names peft's all-linear adapts on the model of `cfg` as modules
        (default: `lora_targets`; a family whose names depend on the config narrows them)."""
        return self.lora_targets

    def mixer_of(self, cfg: Any, layer: int) -> str:
        """The sequence mixer of decoder layer `layer` (0-based), a layer kind the estimators
        and builders dispatch on: "attention" (GQA), "mla", "gated_attention" or
        "gated_delta_net" (models.layers.<kind>)."""
        return "mla" if self.multi_latent_attention else "attention"

    def register_hf_classes(self) -> None:
        """Make transformers' Auto classes know this family's `model_type` when transformers
        itself does not (called once per process by models.hf.config); default: nothing."""

    def biases(self, cfg: Any) -> Biases:
        return Biases()

    def has_qk_norm(self, cfg: Any) -> bool:
        """Whether each attention head's q and k get an RMSNorm (`qk_norm`; a family whose
        config switches it, e.g. GLM-4.5's use_qk_norm, overrides this)."""
        return self.qk_norm

    def extra_layer_parameters(self, cfg: Any) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of one decoder layer that the generic count
        (models.estimate.counting) does not know of, e.g. gpt-oss's attention sinks."""
        return 0, 0

    def layout_problems(self, cfg: Any, tp: int, cp: int) -> list[str]:
        """Why tensor / context parallel sizes `tp` x `cp` cannot run this model beyond
        parallel.layout's head checks (e.g. Gated DeltaNet heads); empty: they can."""
        return []

    def vllm_problems(self, cfg: Any) -> list[str]:
        """Why vLLM (the version rollout.backend=vllm is tested with, 0.32) would not serve or
        sync the model of config `cfg` exactly as transformers and the trainer compute it, one
        sentence each; empty: it does (engine.generation.vllm.settings refuses the backend)."""
        return []

    def rotary_percent(self, cfg: Any) -> float:
        """Fraction of each head's dimensions RoPE rotates (megatron rotary_percent)."""
        return 1.0

    def passthrough(self, cfg: Any, name: str) -> bool:
        """Whether checkpoint tensor `name` is carried unchanged through conversion and
        training without being mapped (e.g. MTP layers; models.hf.passthrough)."""
        return False

    def attention_score_elements(self, cfg: Any, seq_length: int, tp: int) -> float:
        """Attention-score elements per token one GPU keeps per layer for the backward pass
        (memory estimates); 0: flash SDPA keeps none (gpt-oss's sink attention does)."""
        return 0.0

    def length_limit(self, cfg: Any) -> tuple[int, str] | None:
        """(longest sequence, in tokens, the bridge reproduces exactly; the config field that
        sets it) or None: no limit. The engines refuse a longer train.seq_length."""
        return None

    def problems(self, cfg: Any) -> list[str]:
        """Why `cfg` (a transformers config) cannot be converted exactly; empty: it can."""
        return [p for rule in self.fields if rule.problem and (p := rule.problem(cfg))]

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        """HF tensor suffixes of one decoder layer (under model.layers.{i}.)."""
        b = self.biases(cfg)
        names = list(BASE_LAYER_TENSORS)
        if b.qkv:
            names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if b.o_proj:
            names.append("self_attn.o_proj.bias")
        if b.mlp:
            names += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
        if self.has_qk_norm(cfg):
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return tuple(names)

    def layer_tensors_of(self, cfg: Any, layer: int) -> tuple[str, ...]:
        """HF tensor suffixes of decoder layer `layer` (0-based); hybrid families differ by
        layer, the others return `layer_tensors`."""
        return self.layer_tensors(cfg)

    def transformer_kwargs(self, cfg: Any) -> dict:
        """Megatron TransformerConfig kwargs that carry the model's math (no layout, no dtype,
        no RoPE: see models.build.transformer_config). `cfg` passed `problems` (empty)."""
        b = self.biases(cfg)
        heads = field(cfg, "num_attention_heads")
        return dict(
            num_layers=field(cfg, "num_hidden_layers"),
            hidden_size=field(cfg, "hidden_size"),
            num_attention_heads=heads,
            num_query_groups=field(cfg, "num_key_value_heads", heads),
            kv_channels=head_dim(cfg),
            ffn_hidden_size=field(cfg, "intermediate_size"),
            normalization="RMSNorm",
            layernorm_epsilon=field(cfg, "rms_norm_eps", 1e-6),
            gated_linear_unit=True,
            # unknown names were refused by `problems`, or the family ignores the field
            activation_func=ACTIVATIONS.get(field(cfg, "hidden_act", "silu")),
            add_qkv_bias=b.qkv,
            add_bias_linear=b.mlp,  # MLP fc1/fc2; o_proj's bias: models.layers.spec
            qk_layernorm=self.has_qk_norm(cfg),
        )

    def describe(self) -> str:
        return f"{self.model_type} ({self.hf_class})"
