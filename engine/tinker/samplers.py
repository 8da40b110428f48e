"""Which sampler the Tinker service's root runs (the command's --sampler flags): the engine's
hf generation backend (engine.tinker.sampler.EngineSampler) or vLLM's multi-LoRA
(engine.tinker.vllm_sampler.VllmSampler, imported only when asked for)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.tinker.lora import MultiLora
from engine.tinker.sampler import EngineSampler


@dataclass(frozen=True)
class SamplerSettings:
    """The command's sampler flags: `kind` hf (EngineSampler) or vllm (engine.tinker
    .vllm_sampler.VllmSampler: at most `max_loras` adapters on the device at once, ranks up
    to `max_lora_rank`, adapter folders under `folder`)."""
    kind: str = "hf"
    max_loras: int = 4
    max_lora_rank: int = 64
    folder: str = "tinker_state/samplers"


def make_sampler(settings: SamplerSettings, model_dir: str, decode, lora: MultiLora | None):
    """The root's sampler: on the hf backend `lora` is the service's own model (the hf
    sampler shares it); None loads a copy of the folder for it (the Megatron backend)."""
    if settings.kind == "vllm":
        from engine.tinker.vllm_sampler import VllmSampler   # vLLM, only when asked for

        return VllmSampler(model_dir, decode, settings.folder, settings.max_loras,
                           settings.max_lora_rank)
    return EngineSampler(lora if lora is not None else MultiLora.from_folder(model_dir),
                         model_dir, decode)
