"""The HF backend's fast path: a static KV cache, a compiled decode step per shape bucket,
length groups and batch compaction (rollout.hf.static_cache, rollout.hf.compile;
docs/rollout-backends.md#the-hf-backends-static-cache-and-compiled-decode).

One generate call: the rows are cut into length groups (engine.generation.hf.length_buckets);
each group is left-padded to its own longest prompt, padded with filler rows (copies of its
first row, never reported) to its batch bucket, and decoded over a transformers StaticCache of
its cache-length bucket: an eager prefill of the whole prompt block, then one-token decode
steps, each a call of `StaticDecoder.step` (compiled with torch.compile when `compile`, eager
over the same static cache otherwise). The attention mask is the group's full
[batch, cache length] mask, fixed for the whole group (zeros on the left padding, ones
elsewhere: positions not written yet are excluded by causality), so every decode step has the
same shapes. When at most a quarter of the batch still decodes, the running rows' cache rows are
copied into the cache of a smaller power-of-two batch (compaction: hf.length_buckets
.compact_size) and decoding goes on there.

Samples and log-probs are those of the eager loop (engine.generation.hf.backend): the same
SeededSampler draw per (row seed, step), the seeds of the call's rows computed once for the
whole call (so grouping, filler rows and compaction change no row's randomness), the same
positions (real tokens counted per row), the same log-prob contract. What differs is only
rounding: padded columns and rows enter the matmuls and the attention softmax as exact zeros,
but kernels sum in another order: SDPA over the fixed-length masked cache rounds differently
from the eager loop's growing one (tests/test_hf_rollout_static.py, fp32 on the CPU: equal
tokens, log-probs within 3e-6, measured up to 2.4e-6; the eager loop's own log-probs for a row
move by up to 3.6e-6 between decoding it alone and in its batch; docs/rollout-backends.md).

Caches are kept per (batch, cache length) shape and reset before reuse, so a compiled step
(and on CUDA its CUDA graph, mode="reduce-overhead") sees the same cache tensors every call;
the model's parameters are the graph's inputs, so a weight sync (copies into the same tensors)
needs no recompilation. `release()` drops the caches (sleep).
"""
from __future__ import annotations

import dataclasses

import torch
from torch._inductor import cudagraph_trees
from transformers import StaticCache

from engine.generation.base import Generation
from engine.generation.hf.length_buckets import (batch_bucket, cache_bucket, compact_size,
                                                 length_groups)
from engine.generation.hf.settings import resolve
from engine.generation.sampling import SeededSampler, row_seeds

# Layer types whose StaticCache layer is a plain StaticLayer (keys and values of every position)
STATIC_LAYER_TYPES = ("full_attention",)
RECOMPILE_LIMIT = 64  # graphs per decode function: every (batch, cache length) bucket of a run


def static_problem(model) -> str | None:
    """Why `model` cannot decode over the static path (a sliding-window, linear-attention or
    other non-full-attention layer, or no `layer_types` known), or None."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"]
    other = sorted(set(types) - set(STATIC_LAYER_TYPES))
    if other:
        return (f"its layer types {other} are not plain full attention (the static path "
                "copies and compacts whole key/value rows)")
    return None


def static_decoder(engine, static_cache: bool | None, compile: bool | None
                   ) -> "StaticDecoder | None":
    """The decoder an HFRolloutEngine's settings ask for (hf.settings.resolve: None = on with
    CUDA), or None for the eager loop. A model the static path does not serve (a vision tower:
    image prompts decode on the eager loop; layers other than full attention) stays eager under
    None and is refused naming the key under True."""
    static, compiled = resolve(static_cache, compile, engine.device.type)
    if not static:
        return None
    problem = ("it has a vision tower (image prompts decode on the eager loop)"
               if engine.vision is not None else static_problem(engine.model))
    if problem is None:
        return StaticDecoder(engine.model, engine._cache, compiled, engine.device)
    if static_cache or compile:
        key = "rollout.hf.static_cache" if static_cache else "rollout.hf.compile"
        raise ValueError(f"{key}=true is not built for {engine.hf_path}: {problem}; set it to "
                         "null or false")
    return None


@dataclasses.dataclass
class Segment:
    """Decode steps [first, first + len(tokens)) of one batch layout: `slots[j]` is the group
    row in slot j (-1: filler); tokens/logprobs/active are per step [batch] tensors."""
    first: int
    slots: list[int]
    tokens: list[torch.Tensor] = dataclasses.field(default_factory=list)
    logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    active: list[torch.Tensor] = dataclasses.field(default_factory=list)


class StaticDecoder:
    """Static-cache decoding of one HF model (module docstring).

    Args:
        model: the transformers causal LM (eval mode, on `device`).
        cache_keyword: the cache's name in the model's forward (hf.backend.cache_keyword).
        compile: torch.compile the decode step (CUDA: mode="reduce-overhead", CUDA graphs;
            elsewhere the default mode).
        device: where the model runs.
    Attributes:
        shapes: every (batch, cache length) a decode step has run at, in first-use order.
    """

    def __init__(self, model, cache_keyword: str, compile: bool, device: torch.device) -> None:
        self.model, self.device, self.compile = model, device, compile
        self._cache_kw = cache_keyword
        self._caches: dict[tuple[int, int], object] = {}
        self.shapes: list[tuple[int, int]] = []
        self.graph_resets = 0   # cudagraph-tree resets at sleep (`release`)
        self._step = self._forward
        if compile:
            # the limit is this decode function's own (isolated cache), not dynamo's
            # process-wide recompile_limit, which training regions and user code share
            mode = "reduce-overhead" if device.type == "cuda" else None
            self._step = torch.compile(self._forward, dynamic=False, mode=mode,
                                       recompile_limit=RECOMPILE_LIMIT, isolate_recompiles=True)

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def release(self) -> None:
        """Drop the KV caches (the engine sleeps); they are allocated again on the next call.

        With CUDA graphs (compile on CUDA: mode reduce-overhead) the recorded graphs read the
        parameters' and the caches' storage, which sleep frees (parameters go to the meta
        device; wake allocates new ones). torch's cudagraph trees would re-record every shape
        after a wake and keep the old recordings and their memory pool alive, so the pool grew
        with every RL iteration; the trees are reset here instead, deliberately: after a wake
        each (batch, cache length) shape is recorded once more (dynamo's graphs stay: no
        recompilation) and the pool holds one iteration's recordings at most. A weight sync
        without sleep copies into the same storage (update_weights), and nothing is reset.
        `graph_resets` counts the resets."""
        self._caches.clear()
        if self.compile and self.device.type == "cuda":
            cudagraph_trees.reset_cudagraph_trees()
            self.graph_resets += 1

    def cache(self, batch: int, length: int):
        """The reset StaticCache of this shape (allocated on first use)."""
        cache = self._caches.get((batch, length))
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._caches[(batch, length)] = cache
        else:
            cache.reset()
        return cache

    def step(self, input_ids, mask, positions, cache) -> torch.Tensor:
        """fp32 logits [b, V] of one decode step (input_ids and positions [b, 1])."""
        shape = (input_ids.shape[0], mask.shape[1])
        if shape not in self.shapes:
            self.shapes.append(shape)
        if self.compile and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        return self._step(input_ids, mask, positions, cache)

    def generations(self, prompts: list[list[int]], params, pad_id: int,
                    eos_ids: list[int]) -> list[Generation]:
        """`generate` as the backend's Generations (finish "stop" at an eos, else "length")."""
        eos = set(eos_ids)
        return [Generation(prompt_ids=list(prompt), response_ids=ids, response_logprobs=lps,
                           finish_reason="stop" if ids and ids[-1] in eos else "length")
                for prompt, (ids, lps) in zip(prompts, self.generate(prompts, params, pad_id,
                                                                     eos_ids))]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params, pad_id: int,
                 eos_ids: list[int]) -> list[tuple[list[int], list[float]]]:
        """(response ids, their log-probs) per prompt, in order; each response ends at its
        first eos (included) or at params.max_new_tokens."""
        seeds = row_seeds(params, len(prompts))
        result: list = [None] * len(prompts)
        eos = torch.tensor(eos_ids, device=self.device)
        for group in length_groups([len(p) for p in prompts], params.max_new_tokens):
            for row, out in zip(group, self._group([prompts[i] for i in group],
                                                   [seeds[i] for i in group], params,
                                                   pad_id, eos)):
                result[row] = out
        return result

    def _group(self, prompts, seeds, params, pad_id, eos):
        """One length group: prefill, decode with compaction, responses per row."""
        rows, longest = len(prompts), max(len(p) for p in prompts)
        batch = batch_bucket(rows)
        length = cache_bucket(longest + params.max_new_tokens)
        slots = list(range(rows)) + [-1] * (batch - rows)  # fillers: copies of row 0
        ids = torch.full((batch, longest), pad_id, dtype=torch.long)
        mask = torch.ones((batch, length), dtype=torch.long)
        mask[:, :longest] = 0
        for j, row in enumerate(slots):
            prompt = prompts[max(row, 0)]
            ids[j, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[j, longest - len(prompt):longest] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask[:, :longest].cumsum(-1) - 1).clamp(min=0)
        next_pos = positions[:, -1:] + 1
        cache = self.cache(batch, length)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        logits = out.logits[:, -1, :].float()

        slot_seeds = [seeds[max(r, 0)] for r in slots]
        sampler = SeededSampler(dataclasses.replace(params, seeds=slot_seeds), batch,
                                self.device)
        done = torch.tensor([r < 0 for r in slots], device=self.device)
        segments = [Segment(0, slots)]
        for step in range(params.max_new_tokens):
            seg = segments[-1]
            token, logprob = sampler.sample(logits, step)
            seg.active.append(~done)
            seg.tokens.append(token)
            seg.logprobs.append(logprob)
            done = done | torch.isin(token, eos)
            running = int((~done).sum())
            if running == 0 or step == params.max_new_tokens - 1:
                break
            feed = torch.where(done, torch.full_like(token, pad_id), token)
            smaller = compact_size(running, len(seg.slots))
            if smaller is not None:   # keep the running slots (then finished ones as filler)
                keep = torch.argsort(done.to(torch.int8), stable=True)[:smaller]
                cache = self._compact(cache, keep, smaller, length)
                kept, finished = keep.tolist(), done.tolist()
                slots = [-1 if finished[k] else seg.slots[k] for k in kept]
                feed, mask, next_pos, done = feed[keep], mask[keep], next_pos[keep], done[keep]
                sampler = SeededSampler(
                    dataclasses.replace(params, seeds=[slot_seeds[k] for k in kept]),
                    smaller, self.device)
                slot_seeds = [slot_seeds[k] for k in kept]
                segments.append(Segment(step + 1, slots))
            logits = self.step(feed[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1
        return _responses(segments, rows)

    def _compact(self, cache, keep: torch.Tensor, batch: int, length: int):
        """The cache of `batch` rows holding `cache`'s rows `keep`, at the same position."""
        small = self.cache(batch, length)
        for big_layer, layer in zip(cache.layers, small.layers):
            keys, values = big_layer.keys[keep], big_layer.values[keep]
            if not layer.is_initialized:
                layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
            layer.keys.copy_(keys)
            layer.values.copy_(values)
            layer.cumulative_length.copy_(big_layer.cumulative_length)
        return small


def _responses(segments: list[Segment], rows: int) -> list[tuple[list[int], list[float]]]:
    """Every group row's (response ids, log-probs) from the segments' per-step tensors."""
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    for seg in segments:
        tok = torch.stack(seg.tokens, dim=1).cpu().tolist()
        lp = torch.stack(seg.logprobs, dim=1).cpu().tolist()
        act = torch.stack(seg.active, dim=1).cpu().tolist()
        for j, row in enumerate(seg.slots):
            if row < 0:
                continue
            n = sum(act[j])   # active steps are a prefix (a row never restarts)
            tokens[row] += tok[j][:n]
            logprobs[row] += lp[j][:n]
    return list(zip(tokens, logprobs))
