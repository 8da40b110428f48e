"""`rollout.sync_quantization`: what the weight sync sends the rollout engines (docs/rl.md,
docs/deepseek_v3.md).

- null (default): every tensor in the trainer's dtype (model.dtype), as it always did;
- fp8: the weights model.hf_path stores as FP8 (quantization_config quant_method fp8, 128 x 128
  `weight_scale_inv` blocks: DeepSeek-V3, Kimi-K2) are quantized on the trainer with the
  project's block quantizer (models.hf.quantized_stream, the one `tools/convert.py --quantize fp8`
  uses) and sent as the fp8 weight plus its fp32 scale under the published names, which an FP8
  engine's checkpoint loader reads (SGLang's `update_weights_from_tensor`); the other tensors
  go in model.dtype. The engine then holds dequant(quant(W)): FP8 rounding, not the trainer's
  exact weights (rollout/logprob_diff shows it; the importance-sampling keys of
  rollout_correction.* can correct for it).

`sync_quantization_problems` checks the key before any process group starts (and in
`--validate`): the value, a model published in FP8, a backend that takes FP8 weights
(`RolloutEngine.sync_quantizations`), and refuses SGLang engines on an FP8 checkpoint with
the default: they load the checkpoint as FP8 and would cast bf16 updates unscaled; vLLM engines
on any quantized checkpoint with the default (their quantized layers take no model.dtype
weights; `rollout.sync_quantization` is refused for vLLM in vllm.settings).
`sync_source` is the trainer's quantizer for a run (one per process).
"""
from __future__ import annotations

from engine.generation.base import backend_class
from models.formats.quantized import quant_method
from models.hf.quantized_stream import SYNC_METHODS, QuantizedSource, source_problem

SYNC_QUANTIZATIONS = SYNC_METHODS        # besides null
_SOURCES: dict[str, QuantizedSource] = {}


def sync_quantization_problems(cfg, hf_config: dict) -> list[str]:
    """Sentences naming rollout.sync_quantization (empty: fine) for the RL config `cfg` and
    the model's HF config (model.hf_path's config.json, or the model.shape preset)."""
    value, backend = cfg.rollout.sync_quantization, cfg.rollout.backend
    if value is None:
        if backend == "sglang" and quant_method(hf_config) == "fp8":
            return ["rollout.sync_quantization=null with rollout.backend=sglang and a model "
                    "published in FP8 (quantization_config.quant_method fp8): SGLang loads its "
                    "weights as FP8 and would cast model.dtype updates unscaled; set "
                    "rollout.sync_quantization=fp8"]
        if backend == "vllm" and (method := quant_method(hf_config)) is not None:
            return [f"rollout.backend=vllm with a model published quantized "
                    f"(quantization_config.quant_method {method}): vLLM loads "
                    "its weights quantized and a sync sends model.dtype weights, which its "
                    "quantized layers cannot take; point model.hf_path at a model.dtype copy "
                    "(tools/convert.py mcore-to-hf without --quantize writes one) or use "
                    "rollout.backend=hf"]
        return []
    if value not in SYNC_QUANTIZATIONS:
        return [f"rollout.sync_quantization={value!r} is not valid; choose one of null, "
                f"{', '.join(SYNC_QUANTIZATIONS)}"]
    p = []
    problem = source_problem(cfg.model.hf_path, hf_config, value)
    if problem is not None:
        p.append(f"rollout.sync_quantization={value}: {problem}")
    try:
        cls = backend_class(backend)
    except (ValueError, ImportError):  # an unknown backend is reported by rl_problems
        return p
    accepted = tuple(getattr(cls, "sync_quantizations", ()))
    if value not in accepted:
        p.append(f"rollout.sync_quantization={value}: rollout.backend={backend} cannot load "
                 f"{value} weights ({cls.__name__}.sync_quantizations = {accepted}); use "
                 "rollout.backend=hf or sglang, or rollout.sync_quantization=null")
    return p


def sync_source(cfg, hf_config: dict) -> QuantizedSource | None:
    """The trainer's quantizer for rollout.sync_quantization (None: null), built once per
    process from model.hf_path (its stored names; scales read per weight while syncing)."""
    if cfg.rollout.sync_quantization is None:
        return None
    path = str(cfg.model.hf_path)
    if path not in _SOURCES:
        _SOURCES[path] = QuantizedSource(path, hf_config)
    return _SOURCES[path]
