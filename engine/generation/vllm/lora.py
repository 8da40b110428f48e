"""rollout.vllm.lora_sync: how a LoRA policy reaches the vLLM engines (docs/lora.md, "LoRA
policies in the rollout engines"). Read before any process group starts.

- `adapter`: the engines load model.hf_path and keep it, unchanged, for the whole run; every
  sync ships only the adapters, in peft's format (models.lora.peft.export_peft_tensors: names
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ...), and the engine
  serves them with vLLM's LoRA (enable_lora; a new LoRARequest per policy version,
  engine.generation.vllm.adapter). The engine then computes base(x) + scaling * B(A(x)), as
  the trainer does: no adapter delta is rounded away in bf16.
- `merged`: the merged weights base + scaling * B A (models.lora.sites.merged_weight), the
  whole model per sync. In bf16 a delta below half a bf16 ulp of its base weight is rounded
  away, so early in training the engine samples from the base while the trainer's policy
  has moved.
- `auto` (default): `adapter` where model.dtype is bfloat16 and vLLM serves the adapter
  (`adapter_blockers` empty), else `merged`. In float32 the merged weights are exact (the
  delta's rounding is 2^-24 relative: logprob_diff ~1e-6) and vLLM samples without its LoRA
  kernels; in bf16 the adapter sync is the one that follows the trainer.

What vLLM 0.32 serves here (each family's `vllm_lora_targets`, models.families): the attention
(vLLM's qkv_proj / o_proj) and MLP (gate_up_proj / down_proj) projections of the dense GQA
families (Llama, Qwen2, Qwen3: run on CPU at vLLM TP2 against transformers + peft). Refused for
`adapter` (and `merged` under `auto`), each named: every MoE family, whatever the adapter adapts
(with enable_lora vLLM 0.32 runs every fused-MoE layer on its Triton MoE LoRA kernel, which has
no CPU backend: the engine fails at its first forward; on GPUs not run), every other family
(not run), targets the family does not serve, ranks above 512 (vLLM's largest max_lora_rank),
and rollout.sleep_during_train with rollout.vllm.sleep_level=2 (level 2 drops the base weights,
which an adapter sync never sends again).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.lora_settings import lora_spec
from engine.generation.base import backend_class
from models.families.moe import MoeFamily
from models.families.registry import FAMILIES

LORA_SYNC = ("auto", "adapter", "merged")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.32's MaxLoRARanks
# HF projection -> (its module path in a decoder layer, vLLM's LoRA module holding it)
_MODULES = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
            "v_proj": ("self_attn", "qkv_proj"), "o_proj": ("self_attn", "o_proj"),
            "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
            "down_proj": ("mlp", "down_proj")}
PEFT_PREFIX = "base_model.model.model.layers"   # models.lora.peft's names of every adapter


@dataclass(frozen=True)
class AdapterServing:
    """What an engine needs to serve the adapters (VLLMRolloutEngine's `lora`): `spec`
    (models.lora.slices.LoraSpec: rank, alpha, rsLoRA, patterns, written to
    adapter_config.json), `names` (every peft tensor name a sync must bring: lora_A and
    lora_B of each adapted projection of each layer), `vllm_modules` (vLLM's
    lora_target_modules: only these are wrapped) and `max_rank` (vLLM's max_lora_rank: the
    smallest of VLLM_LORA_RANKS >= every rank)."""

    spec: object
    names: frozenset
    vllm_modules: tuple
    max_rank: int

    def engine_args(self) -> dict:
        """vllm.LLM keyword arguments: one adapter slot, two host copies (the new version
        loads before the old one is removed)."""
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1,
                "max_cpu_loras": 2, "lora_target_modules": list(self.vllm_modules)}


def _spec(cfg, hf_config: dict):
    """model.lora.*'s LoraSpec (None: no LoRA)."""
    lora = cfg.model.lora
    if not lora.rank and lora.init_from is None:
        return None
    return lora_spec(cfg, hf_config)


def _ranks(spec) -> list[int]:
    return [spec.rank, *[int(r) for r in (spec.rank_pattern or {}).values()]]


def adapter_blockers(cfg, hf_config: dict, spec) -> list[str]:
    """Why vLLM cannot serve this LoRA policy as an adapter, one sentence per case (empty:
    it can)."""
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type)
    if isinstance(family, MoeFamily):
        return [f"model_type {model_type!r} has MoE layers: with enable_lora vLLM 0.32 runs "
                "every fused-MoE layer, adapted or not, on its Triton MoE LoRA kernel, which has "
                "no CPU backend (the engine fails at its first forward) and has not run on GPUs "
                "here"]
    served = family.vllm_lora_targets if family is not None else ()
    if not served:
        built = [name for name, fam in FAMILIES.items() if fam.vllm_lora_targets]
        return [f"vLLM's LoRA has not run here on model_type {model_type!r} (adapter sync is "
                f"built for {', '.join(built)})"]
    p = []
    others = sorted(spec.targets - set(served))
    if others:
        p.append(f"model.lora.target_modules adapts {others} on model_type {model_type!r}, "
                 f"which vLLM's LoRA does not serve here (served: {', '.join(served)})")
    if max(_ranks(spec)) > VLLM_LORA_RANKS[-1]:
        p.append(f"LoRA rank {max(_ranks(spec))} is above vLLM's largest max_lora_rank "
                 f"{VLLM_LORA_RANKS[-1]}")
    if cfg.rollout.sleep_during_train and cfg.rollout.vllm.sleep_level == 2:
        p.append("rollout.sleep_during_train with rollout.vllm.sleep_level=2 drops the "
                 "engine's base weights, which an adapter sync never sends again; use "
                 "sleep_level=1")
    return p


def lora_sync_mode(cfg, hf_config: dict) -> str | None:
    """"adapter" or "merged" for a LoRA policy on a backend whose engines serve adapters
    (RolloutEngine.serves_lora_adapters: vllm and its subclasses), None otherwise (no LoRA,
    another backend: merged weights). `lora_sync_problems` refuses an explicit `adapter`
    with blockers for rollout.backend=vllm; a subclass named by module path falls back to
    merged where `adapter_blockers` name a case."""
    if not backend_class(cfg.rollout.backend).serves_lora_adapters:
        return None
    spec = _spec(cfg, hf_config)
    if spec is None:
        return None
    mode = cfg.rollout.vllm.lora_sync
    exact = mode == "auto" and cfg.model.dtype != "bfloat16"   # float32: merged is exact
    return "merged" if mode == "merged" or exact or adapter_blockers(cfg, hf_config, spec) \
        else "adapter"


def lora_sync_problems(cfg, hf_config: dict) -> list[str]:
    """rollout.vllm.lora_sync's refusals (rollout.backend=vllm), each naming the key."""
    mode = cfg.rollout.vllm.lora_sync
    if mode not in LORA_SYNC:
        return [f"rollout.vllm.lora_sync={mode!r} is not one of {', '.join(LORA_SYNC)}"]
    if mode != "adapter":
        return []
    spec = _spec(cfg, hf_config)
    if spec is None:
        return ["rollout.vllm.lora_sync=adapter needs a LoRA policy (model.lora.rank > 0 or "
                "model.lora.init_from); use auto or merged"]
    return [f"rollout.vllm.lora_sync=adapter: {why}; use rollout.vllm.lora_sync=merged (or "
            "auto, which falls back to it)" for why in adapter_blockers(cfg, hf_config, spec)]


def adapter_serving(cfg, hf_config: dict) -> AdapterServing | None:
    """The engines' AdapterServing when lora_sync_mode is "adapter", else None."""
    if lora_sync_mode(cfg, hf_config) != "adapter":
        return None
    spec = _spec(cfg, hf_config)
    targets = sorted(spec.targets)
    names = frozenset(f"{PEFT_PREFIX}.{layer}.{_MODULES[t][0]}.{t}.lora_{m}.weight"
                      for layer in range(int(hf_config["num_hidden_layers"]))
                      for t in targets for m in "AB")
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= max(_ranks(spec)))
    return AdapterServing(spec, names, tuple(sorted({_MODULES[t][1] for t in targets})),
                          max_rank)


def lora_engine_kwargs(cfg, hf_config: dict) -> dict:
    """Extra RolloutEngine.from_config arguments: {"lora": AdapterServing} with adapter sync."""
    serving = adapter_serving(cfg, hf_config)
    return {"lora": serving} if serving is not None else {}
