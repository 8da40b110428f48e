"""The checks of engine.tinker.routes' two largest requests, each a BadRequest (400) naming the
field: a forward_backward body (decoded off the event loop; tokens in the vocabulary and the
context, the loss function's inputs and config) and a SampleRequest (the prompt's chunks and
tokens, the sampling params' ranges, stop tokens and strings)."""
from __future__ import annotations

from engine.tinker.losses import LossError, check_loss, check_values
from engine.tinker.request_io import future_answer
from engine.tinker.service import BadRequest, Service
from engine.tinker.wire import decode_forward_backward


def checked_forward_backward(service: Service, owner: str, raw: bytes, encoding: str | None) -> dict:
    """Decode and check a forward_backward body (CPU work, run off the event loop), then queue
    it; the future's answer."""
    model_id, loss_fn, config, forward_only, data = decode_forward_backward(raw, encoding)
    model = service.model(owner, model_id)
    for i, d in enumerate(data):
        if len(d.tokens) > service.max_context:
            raise BadRequest(f"data[{i}].model_input: {len(d.tokens)} tokens exceed the "
                             f"context of {service.max_context}")
        bad = [t for t in d.tokens if not 0 <= t < service.vocab]
        bad_targets = "target_tokens" in d.inputs and bool(
            ((d.inputs["target_tokens"] < 0) | (d.inputs["target_tokens"] >= service.vocab))
            .any())
        if bad or bad_targets:
            field = "model_input" if bad else "loss_fn_inputs.target_tokens"
            raise BadRequest(f"data[{i}].{field}: token ids must be in [0, {service.vocab})")
    for i, d in enumerate(data):
        config_filled = check_loss(loss_fn, set(d.inputs), config)
        try:
            check_values(loss_fn, d.inputs)
        except LossError as e:
            raise LossError(f"data[{i}].{e}") from None
    return future_answer(service.submit("forward_backward", dict(
        adapter=model.adapter, loss_fn=loss_fn, config=config_filled, data=data,
        forward_only=forward_only)), model_id)


def sample_request(service: Service, req) -> tuple[list[int], dict]:
    """(prompt tokens, sampling params) of a SampleRequest; BadRequest naming the field."""
    prompt = []
    for j, chunk in enumerate(req.prompt.chunks):
        if chunk.type != "encoded_text":
            raise BadRequest(f"prompt.chunks[{j}]: chunk type {chunk.type!r} is not served "
                             "(encoded_text)")
        prompt += list(chunk.tokens)
    if not prompt or not all(0 <= t < service.vocab for t in prompt):
        raise BadRequest(f"prompt: needs tokens, each in [0, {service.vocab})")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(req, name):
            raise BadRequest(f"{name}: not served (0 only)")
    if req.target_prompt_logprobs is not None or req.prompt_logprobs_last_n is not None:
        raise BadRequest("target_prompt_logprobs / prompt_logprobs_last_n: not served")
    p = req.sampling_params
    room = service.max_context - len(prompt)
    max_tokens = p.max_tokens if p.max_tokens is not None else room
    if not 1 <= max_tokens <= room:
        raise BadRequest(f"sampling_params.max_tokens {max_tokens} must be in [1, {room}] "
                         f"(context {service.max_context} minus the prompt)")
    if not 1 <= req.num_samples <= 64:
        raise BadRequest(f"num_samples {req.num_samples} must be in [1, 64]")
    if not p.temperature >= 0 or not 0 < p.top_p <= 1:
        raise BadRequest("sampling_params: temperature must be >= 0 and top_p in (0, 1]")
    stop = p.stop if p.stop is not None else []
    stop = [stop] if isinstance(stop, str) else list(stop)
    stop_ids = {s for s in stop if isinstance(s, int)}
    stop_strings = [s for s in stop if isinstance(s, str)]
    if not stop:
        eos = service.tokenizer.eos_token_id
        stop_ids = {eos} if eos is not None else set()
    seed = p.seed if p.seed is not None else (req.seq_id or 0)
    params = dict(max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k,
                  top_p=p.top_p, seed=seed, stop_ids=stop_ids, stop_strings=stop_strings)
    return prompt, params
