"""The rollout engines' settings (`rollout.*`), shared by RL (`python -m engine.rl`, where
`RLConfig.rollout` is a `RolloutConfig`) and `serve` (which builds one for its engine). The
engines themselves (engine.generation) read these fields; engine.generation's per-backend
settings modules (hf/settings.py, vllm/settings.py, sglang/settings.py) check them.

Units: lengths in tokens, times in seconds, `sync_bucket_mb` in MiB.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

@dataclass
class SGLangConfig:
    mem_fraction: float = 0.5            # SGLang mem_fraction_static (colocated with training)


@dataclass
class SpeculativeConfig:
    """rollout.vllm.speculative: speculative decoding in vLLM rollouts (checked by
    engine.generation.vllm.speculative_settings; docs/rollout-backends.md). The rollout's
    log-probs stay the target model's at every position, draft positions included."""
    # null: off | mtp: the policy checkpoint's own MTP layers (synced with the policy when
    # model.mtp.enabled) | draft_model: the HF folder draft_path (never synced)
    method: Optional[str] = None
    num_tokens: int = 2                  # draft tokens proposed per target step (>= 1)
    draft_path: Optional[str] = None     # method=draft_model: the draft's HF folder
    # the automatic off switch: after `patience_steps` RL steps in a row whose acceptance
    # (accepted / proposed draft tokens) is below min_acceptance the engine stops speculating
    # (rebuilt without the draft at the next weight sync). With acceptance a and k draft tokens
    # a target step yields (1 - a^(k+1)) / (1 - a) tokens for 1 + k*c target-forward costs (c:
    # one draft pass over one target pass; an MTP layer of an L-layer model c ~ 1/L plus its
    # share of the head, ~0.1): k = 2, a = 0.3 gives 1.39 tokens for ~1.2, the smallest margin
    # (1.16x) worth keeping once verifying k + 1 tokens is not free (large decode batches);
    # null: never switch off
    min_acceptance: Optional[float] = 0.3
    patience_steps: int = 3              # RL steps in a row below min_acceptance to switch off


@dataclass
class VLLMConfig:
    """rollout.backend=vllm (engine.generation.vllm.settings checks these; TP size inside an
    engine is rollout.gpus_per_engine)."""
    max_model_len: Optional[int] = None  # prompt + response tokens (null: the model's own)
    gpu_memory_utilization: float = 0.5  # GPU: share of device memory for weights + KV cache
    kv_cache_gib: Optional[float] = None  # KV-cache size (null: GPU by utilization, CPU 1 GiB)
    max_num_seqs: Optional[int] = None   # sequences per engine step (null: vLLM's default)
    enforce_eager: Optional[bool] = None  # no CUDA graphs / compile (null: true on CPU only)
    enable_prefix_caching: bool = True   # vLLM's automatic prefix caching (shared prompts)
    sleep_level: int = 1                 # GPU sleep_during_train: 1 offloads weights, 2 drops
    engine_kwargs: dict = field(default_factory=dict)  # any other vllm.EngineArgs field
    # run a vLLM other than the tested release (engine.generation.vllm.version), with a warning
    allow_untested_version: bool = False
    # a LoRA policy reaches the engines as: auto | adapter (vLLM's LoRA serves the adapters,
    # the base stays model.hf_path) | merged (base + adapter as full weights); auto: adapter
    # in bf16 where vLLM serves it, merged in fp32 (engine.generation.vllm.lora)
    lora_sync: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class HFRolloutConfig:
    """rollout.backend=hf (engine.generation.hf.settings checks these; docs/rollout-backends.md
    #the-hf-backends-static-cache-and-compiled-decode)."""
    # a static KV cache per (batch, cache length) bucket, length groups, finished rows compacted
    # out (null: on with CUDA, off on CPU)
    static_cache: Optional[bool] = None
    # torch.compile the decode step over the static cache (CUDA: mode reduce-overhead, CUDA
    # graphs); null: on with CUDA, off on CPU; true needs static_cache true or null
    compile: Optional[bool] = None


@dataclass
class RolloutConfig:
    backend: str = "hf"                  # hf | vllm | sglang | package.module:Class
    num_engines: Optional[int] = None    # rollout engines in the job (null: one per node)
    gpus_per_engine: Optional[int] = None  # devices per engine, SGLang tp_size (null: node/engines)
    n: int = 8                           # responses per prompt (the GRPO group size)
    max_new_tokens: int = 256            # response tokens per sample at most
    temperature: float = 1.0             # sampling temperature (log-probs use the same)
    top_p: float = 1.0                   # nucleus sampling (1.0: off)
    sync_bucket_mb: float = 512.0        # MiB of weights per bucket of the weight sync
    # how a colocated vLLM engine's workers get each bucket: handle (shared tensors: shared
    # memory on CPU, CUDA IPC on GPUs; engine.generation.sync.handles) | file (a file on
    # /dev/shm, bucket_files); hf updates its model in place and ignores it
    sync_transport: str = "handle"
    # null: weights in model.dtype | fp8: the weights model.hf_path stores in FP8 go as FP8 +
    # weight_scale_inv (FP8 engines; engine.generation.sync.quantization)
    sync_quantization: Optional[str] = None
    sleep_during_train: bool = False     # release the engine's memory while training
    check_weight_sync: bool = False      # after each sync compare engine vs trainer logits
    max_retries: int = 2                 # generate calls retried after a backend failure
    retry_wait_s: float = 5.0            # wait before retry k: retry_wait_s * 2**(k-1)
    # asynchronous RL (engine.rl.checks; docs/async-rl.md)
    placement: str = "colocated"         # colocated | disaggregated (own ranks for rollout)
    num_ranks: Optional[int] = None      # disaggregated: the job's last num_ranks ranks
    max_staleness: int = 0               # batch k generated by policy version max(0, k - s)
    # debug, max_staleness >= 1: each batch's log-probs recomputed with the version that sampled
    # it (rollout/behaviour_logprob_diff; engine.rl.disaggregated.behaviour_check)
    check_behaviour_logprobs: bool = False
    peer_timeout_s: float = 600.0        # disaggregated: longest wait for the other side
    # disaggregated: per tensor only the changed elements (or the whole tensor, whichever is
    # smaller) cross to the engine owners (engine.rl.disaggregated.delta); null (auto): on when
    # the job spans more than one node (bytes cross machines), off on one; colocated ignores it
    sync_delta: Optional[bool] = None
    # partial rollouts (engine.rl.collect.partial; docs/async-rl.md, partial rollouts): replies
    # cut after a token budget continue in the next step's batch under the new weights
    partial: bool = False
    # >= 1: a rollout batch keeps ceil(factor x train.prompts_per_step) groups in flight
    partial_oversample: float = 1.5
    # tokens a reply may decode per generation round before it is cut and carried (null:
    # max(1, rollout.max_new_tokens // 4))
    partial_max_new_tokens: Optional[int] = None
    # versions an unfinished reply may span; one that would span more restarts from its prompt
    partial_max_staleness: int = 4
    # true: one step-driver session per step admits replies as engine slots free (a pool of one
    # in-process hf or vllm engine; more fill, more staleness, not layout-tested); false: rounds
    partial_driver: bool = False
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)
