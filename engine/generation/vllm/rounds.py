"""How VLLMRolloutEngine runs one generate call (`generate_call`): a call with per-row fields
(SamplingParams.first_steps / row_max_new_tokens: the rounds of partial rollouts,
engine.rl.collect.partial) is driven step by step with the engine's fill measured
(`stepped_generate`); any other runs vLLM's offline LLM.generate.

The requests are built together by the engine's `vllm_params` (its seed rule over the whole
call, the per-row max_tokens and continuation seeds of engine.generation.vllm.requests) and run
through the step driver (engine.generation.vllm.stepper, vLLM's public add_request / step), so
each request's tokens and log-probs are those LLM.generate gives it (the driver's contract).

Fill (rollout/engine_fill on vLLM; engine.rl.collect.fill): vLLM batches continuously, so a
call's sequence slots are min(B, max_num_seqs) for its B requests (the most it can run at once:
scheduler_config.max_num_seqs), held for the T engine steps the call ran (prefill and decode
steps alike; a step that only prefills a chunk counts as a step with its slots idle). A slot
is busy in a step when its request got at least one new token in it (vLLM's delta outputs:
one per request per step, several tokens counting once under speculative decoding). The call
reports (busy slot-steps, min(B, max_num_seqs) x T).

A stepped call that fails (an engine step raising, a request refused) aborts every request it
added that has not finished before the error is raised (engine.generation.steps'
aborted_on_error): the pool's retry adds the same request ids "0".."B-1" again, and a request
left running in vLLM would hand its tokens to the new request of the same id.
"""
from __future__ import annotations

from engine.generation.base import Generation, SamplingParams
from engine.generation.steps import BusySlots, aborted_on_error
from engine.generation.vllm.library import vllm_module
from engine.generation.vllm.process import preserved_global_rng
from engine.generation.vllm.requests import generation, stop_ids
from engine.generation.vllm.stepper import VLLMStepDriver


def generate_call(engine, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[list[Generation], tuple[int, int] | None]:
    """`engine`'s (a VLLMRolloutEngine) Generations of `prompts`, in order, and the call's
    (busy, total) slot-steps when it ran step by step (module docstring), else None."""
    if params.first_steps is not None or params.row_max_new_tokens is not None:
        return stepped_generate(engine, prompts, params)
    sampling = engine.vllm_params(prompts, params)
    tokens_prompt = vllm_module().TokensPrompt   # the engine's owner imported vLLM already
    with preserved_global_rng():
        outputs = engine.llm.generate([tokens_prompt(prompt_token_ids=p) for p in prompts],
                                      sampling, use_tqdm=False,
                                      lora_request=engine.lora_request())
    return [generation(prompt, out.outputs[0], stop_ids(built))
            for prompt, out, built in zip(prompts, outputs, sampling, strict=True)], None


def stepped_generate(engine, prompts: list[list[int]], params: SamplingParams
                     ) -> tuple[list[Generation], tuple[int, int]]:
    """One Generation per prompt of `engine` (a VLLMRolloutEngine), in order, and the call's
    (busy slot-steps, total slot-steps) (module docstring)."""
    sampling = engine.vllm_params(prompts, params)
    driver = VLLMStepDriver(engine)
    fill, done = BusySlots(), {}
    with aborted_on_error(driver):   # a failed call leaves nothing in vLLM (module docstring)
        for i, (prompt, vllm_params) in enumerate(zip(prompts, sampling)):
            driver.add_built(str(i), prompt, vllm_params, params.temperature == 0, stream=True)
        while driver.busy:
            outputs = driver.step()
            fill.count(outputs)
            done.update({int(out.key): out.done for out in outputs if out.done is not None})
    slots = min(len(prompts), int(engine.vllm_config.scheduler_config.max_num_seqs))
    return [done[i] for i in range(len(prompts))], (fill.busy, slots * driver.steps)
