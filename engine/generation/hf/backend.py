"""Rollout with a plain transformers model: the embedded default backend, works on CPU.

Generation is one batched, left-padded forward over all prompts followed by one-token decode
steps with the model's KV cache; the sampling loop is written out here (no `model.generate`) so
the reported log-probs are exactly those of the sampled tokens (contract in `base.py`). Tokens
are drawn by engine.generation.sampling.SeededSampler: one counter-based uniform per (row seed,
step), inverse CDF over the row's probabilities, for the whole batch in a few tensor ops.

On a CPU, grouped KV heads are read in place, not copied per call (hf.gqa_attention; bitwise).

Sleep/wake (a real release, as SGLang does): `sleep()` moves every parameter to the meta device,
freeing its memory; `wake()` allocates uninitialised storage again on the engine's device, and
`generate()` refuses to run until `update_weights` has written every parameter since the wake.
Small buffers (rotary frequencies) are kept through sleep. The RL loop's order is therefore:
sleep -> train -> wake -> sync_weights -> generate.

FP8 sync (rollout.sync_quantization=fp8, a checkpoint published in FP8; hf.fp8_sync):
transformers loads the folder dequantized (on CPU), and `update_weights` takes each float8
weight together with its `weight_scale_inv` from the same bucket and writes fp8 x scale in fp32
(models.formats.fp8, the blocks of the folder's quantization_config: exactly what the trainer
loads from the checkpoint), so the engine holds dequant(quant(W)). A float8 weight whose scale
is missing, or a scale without its weight, is refused instead of being cast unscaled.

Images (a checkpoint with a vision tower, engine.generation.hf.images): the conditional-
generation model is loaded, prompts may be ImagePrompts, and the prefill passes their pixels and
M-RoPE positions.

Static cache and compiled decode (rollout.hf.*): engine.generation.hf.static_decode decodes text
prompts when on; the eager loop below stays the reference and serves routed experts, images,
per-row step offsets and bounds (SamplingParams.first_steps / row_max_new_tokens: rollout.partial)
and vLLM's sampling fields (SamplingParams.sampling: engine.generation.processing).
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Iterable

import torch

from engine.generation.base import Generation, RolloutEngine, SamplingParams
from engine.generation.eos import eos_token_ids, folder_tokenizer, no_eos_message
from engine.generation.hf.fp8_sync import dequantized, fp8_config
from engine.generation.hf.group_prefill import shared_prefill, shared_prefill_problem
from engine.generation.hf.images import load_model, prefill, view_aliases
from engine.generation.hf.responses import collect_generations, row_limits
from engine.generation.hf.routing import GateRecorder, assemble
from engine.generation.hf.static_decode import static_decoder
from engine.generation.hf.targets import checkpoint_targets
from engine.generation.sampling import SeededSampler
from engine.generation.scoring import SequenceScores, hf_scores
from models.families.registry import family_of
from models.hf.conditional import text_view
from models.vision.inputs import ImagePrompt
from parallel import cpu_runtime


def cache_keyword(model) -> str:
    """The KV cache's name in `model`'s forward and outputs: `cache` from transformers 5.24
    (which warns on the old name and removes it in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


class HFRolloutEngine(RolloutEngine):
    """transformers `AutoModelForCausalLM` (with a vision tower: `AutoModelForImageTextToText`)
    loaded from a local HF directory, in eval mode.

    Args:
        hf_path: local directory with config.json and safetensors weights (nothing is
            downloaded); a tokenizer there, when present, supplies eos/pad ids.
        device: where the model runs; default the current CUDA device, else the CPU.
        dtype: parameter dtype; default the checkpoint's dtype.
        trust_remote_code: the tokenizer may be the folder's own code (model.trust_remote_code,
            models.hf.custom_code.load_tokenizer); the model is always transformers' own class.
        static_cache, compile: rollout.hf.* (from_config passes them; None: by device,
            hf.static_decode.static_decoder); default False: the eager loop.
        model: a text model already loaded from `hf_path`, placed on `device` and in eval
            mode, to generate with instead of loading one (the Tinker service shares its
            multi-LoRA model, engine.tinker.sampler; `dtype` is then not applied, and
            `device` defaults to the model's).
            `update_weights` writes by the names this model's parameters have.
    Attributes:
        model: the transformers model (read it to inspect weights or compute reference logits).
        eos_token_ids: generation stops per sequence at any of these (config, generation
            config and tokenizer eos ids).
        pad_token_id: left-padding id (tokenizer pad, else config pad, else the first eos).
        decoder: the static-path decoder (engine.generation.hf.static_decode.StaticDecoder),
            None on the eager loop.
    """
    supports_logit_probe = True
    supports_scoring = True        # engine.generation.scoring.hf_scores
    supports_images = True         # with a vision tower (engine.generation.hf.images)
    sync_quantizations = ("fp8",)  # float8 weights + scales dequantized on arrival (above)
    _routing: GateRecorder | None = None  # R3: the MoE gates' choices (enable_routed_experts)
    # rows run different weights (the Tinker sampler's per-row LoRA adapters): the prefill is
    # one batch forward, never engine.generation.hf.group_prefill's one per distinct prompt
    rows_differ: bool = False

    @classmethod
    def routed_experts_problem(cls) -> str | None:
        return None  # MoE gates hooked by engine.generation.hf.routing (checked on enable)

    def enable_routed_experts(self) -> None:
        """Report every response's routed experts (Generation.routed_experts)."""
        if self._routing is None:
            self._routing = GateRecorder(self.model)

    @classmethod
    def config_kwargs(cls, rollout_cfg) -> dict:
        """rollout.hf.static_cache / rollout.hf.compile for the constructor (from_config)."""
        return {"static_cache": rollout_cfg.hf.static_cache, "compile": rollout_cfg.hf.compile}

    def __init__(self, hf_path: str, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                 static_cache: bool | None = False, compile: bool | None = False,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__()
        if not os.path.isfile(os.path.join(hf_path, "config.json")):
            raise ValueError(f"rollout hf_path={hf_path!r} is not a local HF model directory "
                             "(config.json missing); nothing is downloaded")
        if device is None and model is not None:
            device = next(model.parameters()).device
        elif device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        self.model, self.vision = load_model(hf_path, dtype, self.device) if model is None \
            else (model, None)
        self._cache = cache_keyword(self.model)
        if dtype is not None and model is None:  # a quantized folder loads with mixed dtypes
            for param in self.model.parameters():
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
        self.hf_path = hf_path
        tokenizer = folder_tokenizer(hf_path, trust_remote_code)
        text_config = self.model.config.get_text_config()   # a wrapper's text model's
        self.eos_token_ids: list[int] = eos_token_ids(hf_path, tokenizer)
        if not self.eos_token_ids:
            raise ValueError(no_eos_message(hf_path))
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        if pad is None:
            pad = getattr(text_config, "pad_token_id", None)
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_ids[0]
        self.vocab_size: int = int(self.model.config.get_text_config().vocab_size)
        self._index_parameters()
        self._stale: set[str] = set()  # parameters not yet written since the last wake()
        self.decoder = static_decoder(self, static_cache, compile)

    # ----------------------------------------------------------------------------- generation
    def _check_ready(self, what: str) -> None:
        if self.is_asleep:
            raise RuntimeError(f"{what}: the rollout engine is asleep; call wake() first")
        if self._stale:
            raise RuntimeError(
                f"{what}: {len(self._stale)} parameters (e.g. {sorted(self._stale)[0]!r}) have "
                "not been written since wake(); stream the trainer's weights with "
                "update_weights / sync_weights before generating")

    @torch.no_grad()
    @cpu_runtime.mode_suspended()   # transformers' model alone: the CPU mode is pure cost here
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self._check_ready("generate")
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad}")
        if self.vision is None and any(isinstance(p, ImagePrompt) for p in prompts):
            raise ValueError(f"{self.hf_path} has no vision tower; prompts with images need one")
        per_row = params.first_steps is not None or params.row_max_new_tokens is not None \
            or params.sampling is not None
        if self.decoder is not None and self._routing is None and not per_row:
            return self.decoder.generations(prompts, params, self.pad_token_id,
                                            self.eos_token_ids)
        batch, longest = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, longest), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends at column -1
            input_ids[i, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, longest - len(prompt):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        if self._routing is not None:
            self._routing.clear()
        if self.vision is None:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # count real tokens; pads get 0
            next_pos, images = positions[:, -1:] + 1, {}
        else:   # M-RoPE positions and the prompts' images
            positions, next_pos, images = prefill(prompts, longest, self.device)
        if shared_prefill_problem(self) is None:   # each distinct prompt's forward once
            logits, cache = shared_prefill(self.model, self._cache, prompts, longest,
                                           self.device)
        else:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1, **images)
            cache, logits = getattr(out, self._cache), out.logits[:, -1, :].float()
        routed = [self._routing.take()] if self._routing is not None else None

        sampler = SeededSampler(params, batch, self.device, prompts, self.eos_token_ids)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        limits = row_limits(params, batch, self.device)   # rows with their own bound
        tokens_per_step, logprobs_per_step, active_per_step = [], [], []
        for step in range(params.max_new_tokens):
            token, logprob = sampler.sample(logits, step)
            active_per_step.append(~done)
            tokens_per_step.append(token)
            logprobs_per_step.append(logprob)
            done = done | sampler.stopped(token)
            if limits is not None:
                done = done | (limits <= step + 1)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)],
                             dim=1)
            feed = torch.where(done, torch.full_like(token, self.pad_token_id), token)
            out = self.model(input_ids=feed[:, None], attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache: cache})
            cache, logits = getattr(out, self._cache), out.logits[:, -1, :].float()
            next_pos = next_pos + 1          # [b, 1], or [3, b, 1] with M-RoPE
            if routed is not None:
                routed.append(self._routing.take())
        result = collect_generations(prompts, tokens_per_step, logprobs_per_step,
                                     active_per_step, sampler.stops)
        if routed is not None:
            tables = assemble(prompts, routed[0], routed[1:],
                              [len(g.response_ids) for g in result])
            for gen, table in zip(result, tables):
                gen.routed_experts = table
        return result

    def _score(self, sequences: list[list[int]], top_k: int) -> list[SequenceScores]:
        """One batched right-padded forward per chunk (engine.generation.scoring.hf_scores)."""
        self._check_ready("score")
        return hf_scores(self.model, sequences, top_k, self.device, self.pad_token_id)

    # ------------------------------------------------------------------------- weights, memory
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model's parameters by HF checkpoint name (one bucket
        per call; experts per expert also where transformers fuses them in memory:
        engine.generation.hf.targets).

        The whole bucket is checked (names, shapes) before anything is copied. With tied
        embeddings, `model.embed_tokens.weight` also sets the output layer; `lm_head.weight`
        is accepted too and writes the same tensor. Dtype and device are converted. A trained
        MTP layer's tensors (models.layers.mtp: the family's pass-through names) are skipped:
        transformers does not build that layer, and this backend does not speculate."""
        if self.is_asleep:
            raise RuntimeError("update_weights: the rollout engine is asleep; call wake() first")
        family, config = self._family
        bucket = [(n, t) for n, t in dequantized(list(named_tensors), self.device,
                                                 lambda: self._fp8_config)
                  if n in self._params or not family.passthrough(config, n)]
        for name, tensor in bucket:
            param = self._params.get(name)
            if param is None:
                examples = ", ".join(list(self._params)[:3])
                raise KeyError(f"update_weights: {name!r} is not a parameter of "
                               f"{type(self.model).__name__} (HF names look like {examples})")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
        for name, tensor in bucket:  # a view of a fused expert tensor copies in place
            self._params[name].copy_(tensor)
            self._stale.discard(self._canonical[name])

    @functools.cached_property
    def _fp8_config(self) -> dict:
        """The folder's fp8 quantization_config, read once (hf.fp8_sync.fp8_config)."""
        return fp8_config(self.hf_path)

    @functools.cached_property
    def _family(self):
        """(the model family, its config dict) of the served model (models.families); a
        conditional-generation wrapper's text view (models.hf.conditional), whose family
        declares the pass-through names (Qwen3.5's mtp.*)."""
        config = text_view(self.model.config.to_dict())
        return family_of(config), config

    def _index_parameters(self) -> None:
        """checkpoint name -> tensor to write (tied aliases included, fused experts as views)
        and name -> canonical name (engine.generation.hf.targets)."""
        self._params, self._canonical = checkpoint_targets(self.model)
        if self.vision is not None:   # the trainer's view names of the text weights
            view_aliases(self._params, self._canonical)

    def _replace_parameters(self, device: torch.device | str) -> None:
        """Swap every parameter for an uninitialised one on `device`, keeping ties (one new
        parameter per old one) and the modules' parameter names."""
        replaced: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:  # the old one is kept alive, so ids stay unique
                    fresh = torch.empty_like(param, device=device)
                    replaced[id(param)] = (param, torch.nn.Parameter(fresh, requires_grad=False))
                module._parameters[name] = replaced[id(param)][1]
        self._index_parameters()

    def sleep(self) -> None:
        """Free the weights: every parameter is replaced by one on the meta device (contents
        discarded)."""
        if self.is_asleep:
            return
        self._replace_parameters("meta")
        if self.decoder is not None:
            self.decoder.release()
        self.mark_asleep(True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Allocate (uninitialised) parameter storage again on the engine's device; the weights
        must then be written with `update_weights` before `generate` is allowed."""
        if not self.is_asleep:
            return
        self._replace_parameters(self.device)
        self.mark_asleep(False)
        self._stale = set(self._canonical.values())

    def probe_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 CPU logits [1, s, V] of the transformers model for `input_ids` [1, s]."""
        self._check_ready("probe_logits")
        with torch.no_grad():
            return self.model(input_ids=input_ids.to(self.device)).logits.float().cpu()
