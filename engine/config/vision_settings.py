"""model.vision.*: the vision tower of a model that takes images (models.vision, docs/vlm.md),
and the checks of the other keys against it (run before any process group starts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from models.estimate.training_memory import micro_batch_tokens
from models.estimate.vision import tower_parameters
from models.vision.spec import vision_spec


@dataclass
class VisionConfig:
    # frozen by default, as LLaMA-Factory's freeze_vision_tower; false: SFT trains it with the
    # language model (RL refuses it: engine.rl.checks)
    freeze: bool = True
    # --validate only: the most image tokens a micro-batch holds (the trained tower's
    # activations scale with them); null: every token of a micro-batch
    max_image_tokens: Optional[int] = None


def vision_estimate(cfg: Any, train: Any) -> tuple[bool, int]:
    """(tower trained, image tokens per micro-batch) for the memory estimate
    (models.estimate.training_memory)."""
    tokens = cfg.model.vision.max_image_tokens
    return (not cfg.model.vision.freeze,
            micro_batch_tokens(train) if tokens is None else int(tokens))


def vision_problems(cfg: Any, hf_config: dict) -> list[str]:
    """model.vision.freeze=false without a vision tower or with LoRA; with deepstack (Qwen3-VL)
    image features, train.recompute=full and deepstack layers beyond the first pipeline stage
    (models.vision.model refuses both at build)."""
    spec = vision_spec(hf_config)
    if spec is None:
        return [] if cfg.model.vision.freeze else [
            "model.vision.freeze=false: the model (model.hf_path) has no vision tower"]
    problems = []
    if not cfg.model.vision.freeze and (cfg.model.lora.rank or 0) > 0:
        problems.append("model.vision.freeze=false with model.lora.rank > 0: a LoRA run trains "
                        "and saves adapters only, so the trained tower would be lost; keep "
                        "the tower frozen (the default) with LoRA")
    deep = spec.deepstack_layers
    if deep and cfg.train.recompute == "full":
        problems.append("train.recompute=full is not supported with deepstack image features "
                        "(Qwen3-VL): a recomputed layer would not see them; use "
                        "train.recompute=selective or none")
    chunks = cfg.parallel.pp * (cfg.parallel.vpp or 1)
    first = int(hf_config["num_hidden_layers"]) // max(chunks, 1)
    if deep and chunks > 1 and first < deep:
        problems.append(f"parallel.pp={cfg.parallel.pp}"
                        + (f" x parallel.vpp={cfg.parallel.vpp}" if cfg.parallel.vpp else "")
                        + f" leaves {first} decoder layer(s) on the first pipeline stage, but "
                        f"deepstack image features enter layers 0..{deep - 1}, which must run "
                        "there with the vision tower")
    return problems


def vision_summary(cfg: Any, hf_config: dict, train: Any) -> list[str]:
    """The --validate line about the vision tower (none for a text model)."""
    tower = tower_parameters(hf_config)
    if not tower:
        return []
    trained, tokens = vision_estimate(cfg, train)
    return [f"vision tower: {tower / 1e9:.2f} B parameters on the first pipeline stage, whole on "
            f"every TP rank, {'trained' if trained else 'frozen (model.vision.freeze)'}"
            + (f"; activations for {tokens} image tokens per micro-batch "
               "(model.vision.max_image_tokens)" if trained else "")]
