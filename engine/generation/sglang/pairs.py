"""Tensors SGLang's DeepSeek loader must receive in ONE `update_weights_from_tensor` call.

SGLang's DeepseekV2ForCausalLM.load_weights (sglang 0.5.23: python/sglang/srt/models/
deepseek_common/deepseek_weight_loader.py) fuses `self_attn.q_a_proj` and
`self_attn.kv_a_proj_with_mqa` of a layer into one `fused_qkv_a_proj_with_mqa` parameter
whenever config.json has a q_lora_rank (DeepSeek-V3,
Kimi-K2; not Moonlight, whose q_proj is not fused): it caches the first of the two and loads
the concatenation when the second arrives, in a cache local to that call. Two halves sent in
different calls are never loaded: the layer would silently keep its old weights. The trainer's
stream (megatron's parameter order, cut into rollout.sync_bucket_mb buckets) may put them in
different buckets, so `PairedBuckets` holds a half (weight or `weight_scale_inv`: FP8 scales
are fused the same way) until its partner comes and passes both in the same call. A weight and
its scale already share a bucket (engine.rl.policy.weight_export.iter_buckets).

Plain Python (no sglang); checked without a GPU by tests/test_rl_sync_quantization.py, the
loader's call-local cache by tests/test_sglang_contract.py.
"""
from __future__ import annotations

from typing import Any

_HALVES = ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.")


def fused_partner(name: str) -> str | None:
    """The name of the other half of a fused q_a / kv_a tensor, or None."""
    for mine, other in (_HALVES, _HALVES[::-1]):
        if f".{mine}" in name:
            return name.replace(mine, other)
    return None


def fuses_qkv_a(hf_config: dict) -> bool:
    """Whether SGLang fuses q_a_proj with kv_a_proj_with_mqa for this config.json."""
    return hf_config.get("q_lora_rank") is not None and "kv_lora_rank" in hf_config


class PairedBuckets:
    """Per engine, across the calls of one sync: `release(bucket)` is the bucket with every
    fused half whose partner has not arrived yet held back, and every held half whose partner
    arrived put right before it; `held` names what still waits (must be empty before
    generating)."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}

    @property
    def held(self) -> list[str]:
        return sorted(self._held)

    def release(self, bucket: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = []
        for name, tensor in bucket:
            other = fused_partner(name)
            if other is None:
                out.append((name, tensor))
            elif other in self._held:
                out += [(other, self._held.pop(other)), (name, tensor)]
            else:
                self._held[name] = tensor
        return out
