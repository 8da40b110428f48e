"""The Tinker service's sampling on the engine's hf generation backend
(engine.generation.hf.backend.HFRolloutEngine) with the sampling session's adapter.

`EngineSampler` holds an HFRolloutEngine around a transformers model whose linears carry the
users' adapters (engine.tinker.lora.MultiLora). On the hf backend that is the service's own
training model (one copy of the weights); on the Megatron backend rank 0 loads the same HF
folder once more for it and receives each sampler's adapter as the full HF tensors the
Megatron model exports (engine.tinker.adapters). A `sample` request runs one engine
`generate` of `num_samples` copies of the prompt with the adapter on every row
(MultiLora.every_row), so it gets the engine's machinery: the prompt prefilled once for all
copies (engine.generation.hf.group_prefill), the KV cache, grouped KV heads read in place on
a CPU, and its sampler (engine.generation.sampling: row i's draws are a function of the
request's seed, i and the step only).

Tinker's SamplingParams as the engine reads them:
- max_tokens -> max_new_tokens; temperature (0: greedy), top_p as given;
- top_k (-1 or 0: off) and the stop token ids -> vLLM's fields (engine.api.sampling_fields:
  top_k after the temperature, before top_p; the reply ends after a stop id, kept, reason
  "stop"). The end-of-sequence ids end a reply only as the request's stop ids say
  (ignore_eos): a request without `stop` is given the tokenizer's eos id
  (engine.tinker.request_checks), one with `stop` ends only there, as Tinker does;
- stop strings: each reply is cut after its first token whose text so far contains one
  (reason "stop"). A row's draws do not depend on its later tokens, so the cut reply is the
  one sampling would have stopped; the rows decode on to max_tokens first (the engine has no
  stop strings), the cost of a request that sets them;
- the reported log-probs follow engine.generation.base's contract: log_softmax(logits / T) of
  the sampled token (T = 1 when greedy), before top-k / top-p, as Tinker reports them.

`compute_logprobs` (the request's prompt_logprobs) is the engine's `score` of the prompt
under the same adapter (temperature 1), NaN for the first token (the SDK's None).

`--sampler vllm` puts the sessions on the engine's vllm backend instead, each adapter a
vLLM LoRARequest (engine.tinker.vllm_sampler); engine.tinker.samplers builds either."""
from __future__ import annotations

import contextlib

from engine.api.sampling_fields import SamplingFields
from engine.generation.base import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.sampling import row_seeds
from engine.tinker.lora import LoraSpec, MultiLora


def engine_params(params: dict, num_samples: int) -> SamplingParams:
    """The engine's SamplingParams for engine.tinker.request_checks' checked `params`
    (max_tokens, temperature, top_k, top_p, seed, stop_ids; stop strings are cut after)."""
    fields = SamplingFields(top_k=max(int(params["top_k"]), 0), ignore_eos=True,
                            stop_token_ids=tuple(sorted(params["stop_ids"])))
    return SamplingParams(max_new_tokens=params["max_tokens"],
                          temperature=params["temperature"], top_p=params["top_p"],
                          seed=params["seed"], sampling=[fields] * num_samples)


def cut_at_stop_string(tokens: list[int], logprobs: list[float], reason: str,
                       stop_strings: list[str], decode) -> tuple[list[int], list[float], str]:
    """The reply cut after its first token whose decoded text so far contains one of
    `stop_strings` (reason "stop"); unchanged when none occurs."""
    if not stop_strings or not any(s in decode(tokens) for s in stop_strings):
        return tokens, logprobs, reason
    for k in range(1, len(tokens) + 1):
        if any(s in decode(tokens[:k]) for s in stop_strings):
            return tokens[:k], logprobs[:k], "stop"
    return tokens, logprobs, reason   # a text that appears only decoded whole


def sample_on(engine, requests: list[dict], decode, rows_of) -> list[tuple[list, list | None]]:
    """Per request ([(tokens, logprobs, stop reason)] * num_samples, the prompt's log-probs or
    None) from a generation engine (engine.generation.base.RolloutEngine). A request:
    {"adapter", "prompt", "num_samples", "params" (checked), "want_prompt_logprobs"}, all
    with one temperature and top_p (engine.tinker.batching.one_call). `rows_of(names)`: a
    context in which the engine's batch row b runs adapter names[b] (None: the base model).
    One generate call covers every request's
    num_samples copies of its prompt, each row with the seed, token bound and fields it has
    alone (row_seeds of the request alone: a request's draws do not depend on the others in
    the call); stop strings cut after; the wanted prompts scored by the engine in one call
    (NaN first, the SDK's None)."""
    prompts, names, seeds, limits, fields = [], [], [], [], []
    for r in requests:
        alone = engine_params(r["params"], r["num_samples"])
        prompts += [list(r["prompt"])] * r["num_samples"]
        names += [r["adapter"]] * r["num_samples"]
        seeds += row_seeds(alone, r["num_samples"])
        limits += [alone.max_new_tokens] * r["num_samples"]
        fields += alone.sampling
    first, longest = requests[0]["params"], max(limits)
    with rows_of(names):
        generations = engine.generate(prompts, SamplingParams(
            max_new_tokens=longest, temperature=first["temperature"], top_p=first["top_p"],
            seeds=seeds, row_max_new_tokens=limits if min(limits) < longest else None,
            sampling=fields))
    wanted = [r for r in requests if r["want_prompt_logprobs"]]
    with rows_of([r["adapter"] for r in wanted]):
        scored = iter(engine.score([list(r["prompt"]) for r in wanted]) if wanted else [])
    out, k = [], 0
    for r in requests:
        rows, k = generations[k:k + r["num_samples"]], k + r["num_samples"]
        seqs = [cut_at_stop_string(g.response_ids, g.response_logprobs, g.finish_reason,
                                   r["params"]["stop_strings"], decode) for g in rows]
        out.append((seqs, [float("nan")] + next(scored).logprobs
                    if r["want_prompt_logprobs"] else None))
    return out


class EngineSampler:
    """Samplers' adapters on a MultiLora model and the engine that samples it (module
    docstring). `decode(token ids) -> str`: the tokenizer's, for stop strings."""

    max_rank = None   # any LoRA rank

    def __init__(self, lora: MultiLora, model_dir: str, decode):
        self.lora, self.decode = lora, decode
        self.engine = HFRolloutEngine(model_dir, model=lora.model)

    def load(self, adapter: str, spec: LoraSpec, tensors: dict) -> None:
        """Sampler adapter `adapter`: exactly `tensors` ({path.A / path.B: full HF tensor}),
        without gradients."""
        self.lora.load(adapter, spec, tensors)
        for p in self.lora.parameters(adapter):
            p.requires_grad_(False)

    def unload(self, adapter: str) -> None:
        """Drop sampler adapter `adapter` (load's)."""
        self.lora.remove(adapter)

    def shutdown(self) -> None:
        """Nothing to stop (the model is the process's own)."""

    def sample(self, requests: list[dict]) -> list[tuple[list, list | None]]:
        """`sample_on` this engine, each request with its adapter (None: the base model)."""
        return sample_on(self.engine, requests, self.decode, self.rows_of)

    @contextlib.contextmanager
    def rows_of(self, names: list[str | None]):
        """Row b runs adapter names[b]: one adapter on every row (MultiLora.every_row, the
        engine's shared prefill kept), else per row (MultiLora.per_row; the prefill one batch
        forward: HFRolloutEngine.rows_differ)."""
        if len(set(names)) <= 1:
            with self.lora.every_row(names[0] if names else None):
                yield
            return
        self.engine.rows_differ = True
        try:
            with self.lora.per_row(names):
                yield
        finally:
            self.engine.rows_differ = False
