"""Prompts checked before they reach vLLM, and vLLM's completions read back as the contract's
Generation (engine.generation.vllm.backend). No vLLM import."""
from __future__ import annotations

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
        if len(prompt) + params.max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                f"{params.max_new_tokens} that exceeds rollout.vllm.max_model_len="
                f"{max_model_len}: raise rollout.vllm.max_model_len or shorten the prompts")


def sampling_args(params: SamplingParams, seed: int, eos_token_ids) -> dict:
    """vllm.SamplingParams' keywords of one request (engine.generation.vllm.backend): one
    sample of at most max_new_tokens, top-p off when greedy, no top-k, the request's `seed`,
    the sampled token's log-prob (by the contract's sampler), ids only (no detokenizing), and
    the backend's stop ids."""
    greedy = params.temperature == 0
    return dict(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                top_p=1.0 if greedy else params.top_p, top_k=0, seed=seed, logprobs=0,
                stop_token_ids=list(eos_token_ids), detokenize=False)


def generation(prompt: list[int], completion, eos_token_ids) -> Generation:
    """vLLM's CompletionOutput of `prompt` as a Generation: the sampled ids, the contract's
    log-prob of each (the engine runs the ContractLogprobs sampler), "stop" exactly when the
    last token is an eos id."""
    tokens = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r}")
    stopped = bool(tokens) and tokens[-1] in eos_token_ids
    if (completion.finish_reason == "stop") != stopped:
        raise RuntimeError(f"vLLM finish_reason {completion.finish_reason!r} but the last "
                           f"token is {tokens[-1:]}")
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    return Generation(prompt_ids=list(prompt), response_ids=tokens,
                      response_logprobs=logprobs, finish_reason=completion.finish_reason)
