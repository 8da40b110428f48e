"""The log-prob contract on vLLM's speculative path, in vLLM's worker process
(engine.generation.vllm.worker installs it on an engine built with a speculative_config).

With speculation vLLM samples through its RejectionSampler (vllm.v1.sample.rejection_sampler),
not only through the sampler the contract wraps (vllm.worker.ContractLogprobs): the bonus token
still goes through that sampler, but the tokens at draft positions are accepted or resampled by
the rejection sampler, which computes their log-probs itself. Two things keep them the
contract's, log_softmax(logits_t / T)[y_t] of the unmodified logits before top-k/top-p
(engine.generation.base), as without speculation:

- `expand_batch_to_tokens`: vLLM 0.32's CPU fallback for the rejection sampler's
  `expand_kernel` (vllm.utils.cpu_triton_utils) hands the C++ kernel an int64 copy of a float32
  or int32 output and leaves the real output uninitialised (vllm-project/vllm#55005, fix
  #55006), so at T > 0 the per-token temperature, top-k and top-p at draft positions are
  garbage (wrong accept/reject decisions, log-probs up to 27 nats off; greedy never reads
  them). `install` replaces the module's function with a `repeat_interleave` version, only
  where the installed one gives a wrong answer on tiny tensors (`expand_is_broken`), never by
  version string.
- `ContractSpecLogprobs`: the rejection sampler filters the temperature-scaled logits by
  top-k/top-p in place (`apply_sampling_constraints`) and takes its log-probs from the filtered
  ones: renormalised over the kept tokens (measured 0.105 off at 6 of 512 positions at top-p
  0.9). The hook replaces `apply_sampling_constraints` with one that keeps the scaled logits
  before the filter (a copy only when a filter is on) and hands them, not the filtered ones, to
  the instance's `_get_logprobs_tensors`. Sampling (accept, reject, recover) still uses the
  filtered distribution, as vLLM does.

- `seeded_draft_sample`: with draft_sample_method="probabilistic" vLLM 0.32 samples the draft
  tokens with exponential noise from the worker's global RNG ("TODO(woosuk): Consider seeds" in
  llm_base_proposer.compute_probs_and_sample_next_token), so a seeded response at T > 0 depended
  on what the worker ran before and on the batch (measured: the same seeded call twice on one
  engine gave different tokens), breaking the engine's rule that a response depends on its own
  prompt and seed only. The replacement draws a seeded request's noise from that request's
  generator, as vLLM's sampler and rejection sampler do; the distribution is unchanged.

Penalties, bad words and logit processors are not part of the contract and the engine never sets
them (vllm.backend's SamplingParams).
"""
from __future__ import annotations

import importlib

import torch

REJECTION_MODULE = "vllm.v1.sample.rejection_sampler"
PROPOSER_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
SAMPLING_EPS = 1e-5   # vLLM's sampler: a temperature below it is greedy


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens`, correct on every platform: [batch] -> [num_tokens],
    x[i] repeated for request i's tokens (cu_num_tokens: cumulative token counts), values equal
    to `replace_from` replaced by `replace_to`. x = [a, b, c], cu = [2, 5, 6] ->
    [a, a, b, b, b, c]."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    out = x.repeat_interleave(counts.to(x.device), output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def expand_is_broken(expand) -> bool:
    """Whether `expand` (vLLM's expand_batch_to_tokens or a stand-in) gets a float32 and an
    int32 expansion wrong on tiny tensors (the dtypes of temperature and top-k)."""
    cu = torch.tensor([2, 3], dtype=torch.int32)
    cases = ((torch.tensor([0.7, 0.0]), torch.tensor([0.7, 0.7, 1.0]), 1),
             (torch.tensor([5, 9], dtype=torch.int32),
              torch.tensor([5, 5, 9], dtype=torch.int32), 0))
    for x, want, replace_to in cases:
        got = expand(x, cu, 3, replace_from=0, replace_to=replace_to)
        if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
            return True
    return False


class ContractSpecLogprobs:
    """The rejection sampler's log-probs made the contract's (module docstring). `scaled`: the
    temperature-scaled, unfiltered target logits of the running forward (None outside one)."""

    def __init__(self, rejection_sampler) -> None:
        self.module = importlib.import_module(REJECTION_MODULE)
        self.apply_top_k_top_p = self.module.apply_top_k_top_p
        self.greedy_temperature = int(self.module.GREEDY_TEMPERATURE)
        self.scaled: torch.Tensor | None = None
        self.logprobs_tensors = rejection_sampler._get_logprobs_tensors
        rejection_sampler._get_logprobs_tensors = self.contract_logprobs_tensors
        self.module.apply_sampling_constraints = self.sampling_constraints
        self.calls = 0   # forwards whose draft log-probs came from the unfiltered logits

    def sampling_constraints(self, logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                             sampling_metadata) -> torch.Tensor:
        """vLLM's apply_sampling_constraints (temperature, then top-k/top-p, in place), keeping
        the scaled logits before the filter in `scaled`."""
        self.scaled = None
        if sampling_metadata.all_greedy:
            return logits
        expand, n = self.module.expand_batch_to_tokens, logits.shape[0]
        temperature = expand(sampling_metadata.temperature, cu_num_draft_tokens, n,
                             replace_from=self.greedy_temperature, replace_to=1)
        logits.div_(temperature.unsqueeze(-1))
        top_k = (expand(sampling_metadata.top_k, cu_num_draft_tokens, n)
                 if sampling_metadata.top_k is not None else None)
        top_p = (expand(sampling_metadata.top_p, cu_num_draft_tokens, n)
                 if sampling_metadata.top_p is not None else None)
        if top_k is None and top_p is None:
            self.scaled = logits
            return logits
        self.scaled = logits.clone()
        return self.apply_top_k_top_p(logits, top_k, top_p)

    def contract_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits,
                                  bonus_logits, sampled_token_ids):
        """The instance's _get_logprobs_tensors with the unfiltered scaled logits at the draft
        positions (greedy: the raw logits, T = 1)."""
        scaled, self.scaled = self.scaled, None
        if scaled is not None:
            target_logits = scaled
            self.calls += 1
        return self.logprobs_tensors(max_num_logprobs, metadata, logits, target_logits,
                                     bonus_logits, sampled_token_ids)


def seeded_draft_sample(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's compute_probs_and_sample_next_token (the draft's probabilistic sampling:
    temperature, softmax, exponential-noise argmax; greedy rows argmax), with the noise of
    every request that has a generator (a seed) drawn from it. One row per request (MTP and
    draft-model drafters); returns (draft token ids, draft probabilities)."""
    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    temperature = sampling_metadata.temperature
    if temperature.shape[0] != logits.shape[0]:
        raise RuntimeError(f"draft sampling: {logits.shape[0]} rows for "
                           f"{temperature.shape[0]} requests")
    if not sampling_metadata.all_random:
        is_greedy = temperature < SAMPLING_EPS
        temperature = torch.where(is_greedy, 1.0, temperature)
    logits.div_(temperature.view(-1, 1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty(probs.shape, dtype=torch.float64 if use_fp64_gumbel else probs.dtype,
                    device=probs.device)
    q.exponential_()
    for i, generator in sampling_metadata.generators.items():
        q[i].exponential_(generator=generator)
    scores = probs / q if q.dtype == probs.dtype else probs.to(q.dtype) / q
    next_token_ids = scores.argmax(dim=-1).view(-1)
    if not sampling_metadata.all_random:
        next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
    return next_token_ids, probs


def install(rejection_sampler) -> dict:
    """Make `rejection_sampler`'s log-probs the contract's in this process: vLLM's
    expand_batch_to_tokens replaced where it is broken, the ContractSpecLogprobs hook on, the
    draft's sampling seeded per request (`seeded_draft_sample`).
    Returns {"expand_patched": bool, "hook": the hook} (idempotent: a second call returns the
    first hook)."""
    hook = getattr(rejection_sampler, "rl_contract_hook", None)
    if hook is not None:
        return {"expand_patched": hook.expand_patched, "hook": hook}
    module = importlib.import_module(REJECTION_MODULE)
    patched = expand_is_broken(module.expand_batch_to_tokens)
    if patched:
        module.expand_batch_to_tokens = expand_batch_to_tokens
        if expand_is_broken(module.expand_batch_to_tokens):
            raise RuntimeError("the repeat_interleave expand_batch_to_tokens is broken too")
    hook = ContractSpecLogprobs(rejection_sampler)
    hook.expand_patched = patched
    importlib.import_module(PROPOSER_MODULE).compute_probs_and_sample_next_token = \
        seeded_draft_sample
    rejection_sampler.rl_contract_hook = hook
    return {"expand_patched": patched, "hook": hook}
