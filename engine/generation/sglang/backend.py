"""Rollout with SGLang's offline engine (GPU only; `pip install -e .[gpu]`).

Follows the Python `sglang.Engine` API of sglang 0.5.23 (engine.generation.sglang.settings:
the tested release, every name used, the arguments built; python/sglang/srt/entrypoints/
engine.py): `Engine(**ServerArgs fields)`,
`generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)` returning
one dict per prompt whose `meta_info["output_token_logprobs"]` is a list of
(logprob, token_id, text) and `meta_info["finish_reason"]` a dict with a "type";
a weight sync is one session, `begin_weight_update()`, then
`update_weights_from_tensor(named_tensors=[...], flush_cache=False)` per bucket, then
`end_weight_update()` (which finalizes quantized weights into kernel layout) and
`flush_cache()`, each returning a success flag and a message that is read: a failed call
raises with SGLang's message, and the engine then reports itself dead (`is_alive`) so the RL
loop restarts it rather than sampling from partly updated weights;
`release_memory_occupation()` / `resume_memory_occupation()` (with enable_memory_saver).

Seeds: SGLang honours a request's `sampling_seed` only with enable_deterministic_inference
(and then seeds a request without one with 42), so the engine always runs in that mode and
every request carries a seed: the per-response seeds, else `seed + i`, else fresh random ones
(SamplingParams.seed None). Device cpu is refused (sglang.settings.device_problem).

Log-probs: with SGLANG_RETURN_ORIGINAL_LOGPROB unset (its default), SGLang reports
log_softmax(logits / T) of the sampled token, and log_softmax(logits) when greedy: the contract
of `base.py`. The constructor refuses to run with that variable switched on.

Sleep/wake: `release_memory_occupation` frees the KV cache and the weights (the memory saver
does not keep their contents), so after `wake()` the trainer's weights must be streamed again with
`update_weights` before generating, exactly as with the HF backend. The memory saver is on only
with rollout.sleep_during_train (it needs the torch_memory_saver package).

FP8 (rollout.sync_quantization=fp8): SGLang loads a checkpoint published in FP8 as FP8, and
`update_weights_from_tensor` hands the named tensors to the model's own `load_weights`, the
checkpoint loader: float8 weights with their fp32 `weight_scale_inv` under the published names
are what it reads from disk (slime syncs DeepSeek-V3 this way). DeepSeek's loader fuses q_a_proj
with kv_a_proj_with_mqa within one call: engine.generation.sglang.pairs keeps the halves
together. Written to SGLang's source; not run here (SGLang's CPU kernel is not on the registry,
and SGLang refuses seeded sampling on CPUs anyway): docs/rollout-backends.md.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import secrets
from typing import Iterable

import numpy as np
import torch

from engine.generation.base import Generation, RolloutEngine, SamplingParams
from engine.generation.sglang.pairs import PairedBuckets, fuses_qkv_a
from engine.generation.sglang.settings import (checked, engine_arguments, record_field_names,
                                               version_problem)

MISSING_SGLANG = ("rollout.backend=sglang needs the sglang package: pip install -e .[gpu]; "
                  "on CPU use rollout.backend=hf")


class SGLangRolloutEngine(RolloutEngine):
    """An `sglang.Engine` on the HF checkpoint directory `hf_path`.

    Args:
        tp_size: SGLang tensor-parallel size (GPUs used by this engine).
        mem_fraction_static: fraction of GPU memory SGLang reserves for weights + KV cache; keep
            it low enough for the colocated trainer.
        dtype: SGLang dtype string ("auto", "bfloat16", ...).
        random_seed: SGLang's engine seed.
        enable_memory_saver: needed for sleep/wake (release/resume memory occupation); needs
            the torch_memory_saver package (refused by name without it). SGLang's default, off.
        engine_kwargs: any other `sglang.srt.server_args.ServerArgs` field
            (enable_deterministic_inference is always on: refused when set False).
    """
    sync_quantizations = ("fp8",)  # FP8 checkpoints load as FP8; updates in the same layout

    @classmethod
    def from_config(cls, hf_path: str, rollout_cfg, dtype, seed: int,
                    gpus: tuple[int, int] = (0, 1), routed_experts: bool = False,
                    trust_remote_code: bool = False) -> "SGLangRolloutEngine":
        """On the node's devices [gpus[0], gpus[0] + gpus[1]) (tp_size = gpus[1], the
        placement's rollout.gpus_per_engine), with rollout.sglang.mem_fraction; model.dtype is
        left to SGLang ("auto": the checkpoint's dtype). The memory saver is on exactly with
        rollout.sleep_during_train (the only caller of sleep/wake). `routed_experts` (R3):
        SGLang's enable_return_routed_experts (routed_experts_problem says when it is missing).
        `trust_remote_code` (model.trust_remote_code): SGLang's server arg of that name, with
        which SGLang loads the folder's tokenizer code (and reads its config.json with the
        folder's configuration code; the model is SGLang's own)."""
        # several engines on one node: distinct base ports, so their derived ports differ
        extra = {"enable_return_routed_experts": True} if routed_experts else {}
        return cls(hf_path, tp_size=gpus[1], base_gpu_id=gpus[0], port=30000 + 100 * gpus[0],
                   mem_fraction_static=rollout_cfg.sglang.mem_fraction, random_seed=seed,
                   enable_memory_saver=bool(rollout_cfg.sleep_during_train),
                   trust_remote_code=trust_remote_code, **extra)

    @classmethod
    def routed_experts_problem(cls) -> str | None:
        """SGLang returns routed experts only from versions whose ServerArgs has
        enable_return_routed_experts (meta_info["routed_experts"], as slime's R3 reads it)."""
        return sglang_routed_experts_problem()

    def __init__(self, hf_path: str, tp_size: int = 1, mem_fraction_static: float = 0.5,
                 dtype: str = "auto", random_seed: int = 0, enable_memory_saver: bool = False,
                 **engine_kwargs) -> None:
        super().__init__()
        try:
            import sglang  # optional: the gpu extra
        except ModuleNotFoundError as err:
            if err.name != "sglang":  # sglang is there but one of its dependencies is not
                raise
            raise RuntimeError(MISSING_SGLANG) from err
        problem = version_problem(getattr(sglang, "__version__", None))
        if problem:
            raise RuntimeError(problem)
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise RuntimeError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report "
                               "log-probs before temperature scaling, breaking the rollout "
                               "log-prob contract; unset it")
        kwargs = engine_arguments(hf_path, tp_size=tp_size,
                                  mem_fraction_static=mem_fraction_static, dtype=dtype,
                                  random_seed=random_seed,
                                  enable_memory_saver=enable_memory_saver, **engine_kwargs)
        with open(os.path.join(hf_path, "config.json")) as f:
            self._pairs = PairedBuckets() if fuses_qkv_a(json.load(f)) else None
        self.memory_saver = bool(enable_memory_saver)
        self.routed_experts = bool(engine_kwargs.get("enable_return_routed_experts"))
        self._sync_open = False     # between begin_weight_update and end_weight_update
        self._sync_error: str | None = None
        self.engine = sglang.Engine(**kwargs)

    @property
    def is_alive(self) -> bool:
        """False after a failed weight-update call: the weights are partly updated, so the RL
        loop restarts the engine instead of retrying it."""
        return self._sync_error is None

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self._close_sync()
        sampling = [{"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                     "top_p": params.top_p, "sampling_seed": seed}
                    for seed in request_seeds(params, len(prompts))]
        extra = {"return_routed_experts": True} if self.routed_experts else {}
        outputs = self.engine.generate(input_ids=prompts, sampling_params=sampling,
                                       return_logprob=True, **extra)
        if isinstance(outputs, dict):
            outputs = [outputs]
        gens = [self._to_generation(p, out) for p, out in zip(prompts, outputs, strict=True)]
        if self.routed_experts:
            for gen, out in zip(gens, outputs):
                gen.routed_experts = decode_routed_experts(out["meta_info"], gen)
        return gens

    @staticmethod
    def _to_generation(prompt: list[int], out: dict) -> Generation:
        meta = out["meta_info"]
        triples = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {reason!r}")
        return Generation(prompt_ids=list(prompt),
                          response_ids=[int(t[1]) for t in triples],
                          response_logprobs=[float(t[0]) for t in triples],
                          finish_reason=kind)

    def _refuse_after_failure(self) -> None:
        if self._sync_error is not None:
            raise RuntimeError(f"an SGLang weight update failed ({self._sync_error}); the "
                               "engine holds partly updated weights and must be restarted")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full HF-named tensors; the first bucket of a sync opens SGLang's
        weight-update session, the next generate closes it and flushes the KV/prefix cache once.
        A fused q_a / kv_a half waits for its partner (sglang.pairs)."""
        self._refuse_after_failure()
        tensors = list(named_tensors)
        if self._pairs is not None:
            tensors = self._pairs.release(tensors)
        if not tensors:
            return
        try:
            if not self._sync_open:
                checked(self.engine.begin_weight_update(), "begin_weight_update")
                self._sync_open = True
            checked(self.engine.update_weights_from_tensor(named_tensors=tensors,
                                                           flush_cache=False),
                    "update_weights_from_tensor")
        except RuntimeError as err:
            self._sync_error = str(err)
            raise

    def _close_sync(self) -> None:
        """End an open weight-update session (finalize, then flush the cache once)."""
        self._refuse_after_failure()
        if self._pairs is not None and self._pairs.held:
            raise RuntimeError(f"the weight sync ended with {self._pairs.held[0]!r} waiting for "
                               "its fused q_a_proj / kv_a_proj_with_mqa partner")
        if not self._sync_open:
            return
        self._sync_open = False
        try:
            checked(self.engine.end_weight_update(), "end_weight_update")
            checked(self.engine.flush_cache(), "flush_cache")
        except RuntimeError as err:
            self._sync_error = str(err)
            raise

    def sleep(self) -> None:
        """Release SGLang's GPU memory (weights and KV cache); needs the memory saver
        (rollout.sleep_during_train=true builds the engine with it)."""
        if not self.memory_saver:
            raise RuntimeError("SGLang's engine was built without enable_memory_saver, so it "
                               "cannot release its memory; set rollout.sleep_during_train=true")
        self._close_sync()
        self.engine.release_memory_occupation()
        self.mark_asleep(True)

    def wake(self) -> None:
        """Re-acquire SGLang's GPU memory; stream the weights with `update_weights` next."""
        self.engine.resume_memory_occupation()
        self.mark_asleep(False)

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes."""
        self.engine.shutdown()


def request_seeds(params: SamplingParams, count: int) -> list[int]:
    """One sampling_seed per request: `params.seeds` (per response), else `params.seed + i`
    (distinct per prompt: GRPO repeats identical prompts), else fresh random 63-bit seeds
    (SGLang's deterministic mode would give every unseeded request the same seed, 42)."""
    if params.seeds is not None:
        return [int(s) for s in params.seeds]
    if params.seed is not None:
        return [params.seed + i for i in range(count)]
    return [secrets.randbits(63) for _ in range(count)]


def sglang_routed_experts_problem() -> str | None:
    """None when the installed sglang can return routed experts, else why not."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (" + MISSING_SGLANG + ")"
    from sglang.srt.server_args import ServerArgs  # optional: the gpu extra

    if "enable_return_routed_experts" not in record_field_names(ServerArgs):
        import sglang  # optional: the gpu extra
        return (f"sglang {getattr(sglang, '__version__', '?')} cannot return routed experts "
                "(its ServerArgs has no enable_return_routed_experts); upgrade sglang or use "
                "moe.routing_replay=R2")
    return None


def decode_routed_experts(meta: dict, gen: Generation) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 of int32 [tokens, layers, k], or nested lists) as
    [len(prompt) + len(response) - 1, layers * k] int32 (Generation.routed_experts)."""
    raw = meta.get("routed_experts")
    if raw is None:
        raise RuntimeError("SGLang returned no meta_info['routed_experts'] although "
                           "enable_return_routed_experts is on")
    rows = len(gen.prompt_ids) + len(gen.response_ids) - 1
    values = (np.frombuffer(base64.b64decode(raw), dtype=np.int32) if isinstance(raw, str)
              else np.asarray(raw, dtype=np.int32))
    if rows <= 0 or values.size % rows:
        raise RuntimeError(f"SGLang routed_experts has {values.size} values, not a multiple of "
                           f"the {rows} tokens fed to the trainer")
    return torch.from_numpy(values.reshape(rows, -1).copy())
