"""Prompts checked before they reach vLLM, each request's vLLM sampling arguments, and vLLM's
completions read back as the contract's Generation (engine.generation.vllm.backend). No vLLM
import.

Per-row fields (SamplingParams.row_max_new_tokens / first_steps; rollout.partial):
row_max_new_tokens[i] is request i's vLLM max_tokens (exact). first_steps cannot be applied as
the hf backend does: vLLM 0.32 seeds one torch generator per request when the request starts
(`manual_seed(seed)` in its model runner; SamplingParams has a seed and no offset), and how many
numbers a decode step draws from it is the sampler's own business (one randint per step on CPU,
a vocabulary-wide exponential_ on GPU, other counts under speculative decoding), so a
continuation cannot redraw the uninterrupted reply's numbers. A row with first_steps[i] = k > 0
is seeded instead with `continuation_seed(seed_i, k)`: a deterministic fresh draw (the same
seed, prefix and weights give the same tokens), a valid sample of the policy continuing the
prefix, not the tokens the uninterrupted reply would have drawn.

vLLM's sampling fields (SamplingParams.sampling[i], `serve`): handed to vLLM as they are
(top_k, min_p, the penalties, logit_bias, ignore_eos; min_tokens at most the request's
max_tokens, which vLLM refuses otherwise: a reply cut there is cut either way), its stop ids
(SamplingFields.stop_ids: the engine's eos ids unless ignore_eos, and stop_token_ids) as vLLM's
stop_token_ids; `stop_ids` reads them back from a built request (what ends it: finish_reason
"stop").
Such a request's log-probs stay the contract's (the unshaped logits / T: vLLM's processors
run after engine.generation.vllm.worker.keep_unshaped kept them).
"""
from __future__ import annotations

import hashlib

from engine.generation.base import Generation, SamplingParams


def check_prompts(prompts: list[list[int]], params: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Refuse a token id outside [0, vocab_size) and a prompt with len(prompt) +
    max_new_tokens > max_model_len (rollout.vllm.max_model_len), naming the prompt's position
    (vLLM itself refuses only len(prompt) >= max_model_len and shortens the others
    silently)."""
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        if len(prompt) + row_max_tokens(params, i) > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                f"{row_max_tokens(params, i)} that exceeds rollout.vllm.max_model_len="
                f"{max_model_len}: raise rollout.vllm.max_model_len or shorten the prompts")


def row_max_tokens(params: SamplingParams, i: int) -> int:
    """Request i's bound on response tokens: row_max_new_tokens[i], else max_new_tokens."""
    rows = params.row_max_new_tokens
    return int(rows[i]) if rows is not None else int(params.max_new_tokens)


def continuation_seed(seed: int, first_step: int) -> int:
    """The vLLM seed of a row whose first sampled token counts as decode step `first_step`
    (SamplingParams.first_steps; module docstring): `seed` itself when first_step == 0 (a fresh
    reply is seeded as without partial rollouts), else the first 8 bytes (little-endian) of
    BLAKE2b(b"vllm-continuation:<seed>:<first_step>", digest_size=8) mod 2**31."""
    if first_step == 0:
        return int(seed)
    digest = hashlib.blake2b(f"vllm-continuation:{int(seed)}:{int(first_step)}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2 ** 31


def sampling_args(params: SamplingParams, i: int, seed: int, eos_token_ids) -> dict:
    """vllm.SamplingParams' keywords of request i (engine.generation.vllm.backend): one
    sample of at most row_max_tokens(params, i), top-p off when greedy, no top-k, the seed
    continuation_seed(seed, first_steps[i]) (`seed`: the request's seed by the backend's rule),
    the sampled token's log-prob (by the contract's sampler), ids only (no detokenizing), and
    the backend's stop ids; with sampling fields (module docstring) theirs."""
    greedy = params.temperature == 0
    first = int(params.first_steps[i]) if params.first_steps is not None else 0
    args = dict(n=1, max_tokens=row_max_tokens(params, i), temperature=params.temperature,
                top_p=1.0 if greedy else params.top_p, top_k=0,
                seed=continuation_seed(seed, first), logprobs=0,
                stop_token_ids=list(eos_token_ids), detokenize=False)
    fields = params.sampling[i] if params.sampling is not None else None
    if fields is not None:
        args.update(top_k=fields.top_k, min_p=fields.min_p,
                    repetition_penalty=fields.repetition_penalty,
                    presence_penalty=fields.presence_penalty,
                    frequency_penalty=fields.frequency_penalty,
                    logit_bias=dict(fields.logit_bias) or None, ignore_eos=fields.ignore_eos,
                    min_tokens=min(fields.min_tokens, args["max_tokens"]),
                    stop_token_ids=sorted(fields.stop_ids(eos_token_ids)))
    return args


def stop_ids(vllm_params) -> frozenset[int]:
    """The ids that end a request built by `sampling_args`: the stop_token_ids it wrote, which
    are the whole set (the engine's eos ids; with sampling fields SamplingFields.stop_ids, the
    one place of the rule: eos unless ignore_eos, and stop_token_ids)."""
    return frozenset(vllm_params.stop_token_ids or ())


def generation(prompt: list[int], completion, eos_token_ids) -> Generation:
    """vLLM's CompletionOutput of `prompt` as a Generation: the sampled ids, the contract's
    log-prob of each (the engine runs the ContractLogprobs sampler; NaN for each when the
    request asked for none: the step driver's logprobs=False, vllm.stepper), "stop" exactly
    when the last token is one of `eos_token_ids` (the request's stop ids: `stop_ids`)."""
    tokens = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r}")
    stopped = bool(tokens) and tokens[-1] in eos_token_ids
    if (completion.finish_reason == "stop") != stopped:
        raise RuntimeError(f"vLLM finish_reason {completion.finish_reason!r} but the last "
                           f"token is {tokens[-1:]}")
    logprobs = [float("nan")] * len(tokens) if completion.logprobs is None else \
        [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    return Generation(prompt_ids=list(prompt), response_ids=tokens,
                      response_logprobs=logprobs, finish_reason=completion.finish_reason)
