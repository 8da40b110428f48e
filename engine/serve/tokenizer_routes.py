"""The tokenizer routes of `serve`, at the server root as vLLM and SGLang serve them (what
lm-evaluation-harness's RemoteTokenizer and check_remote_tokenizer_support read), and the
model route `client.models.retrieve` calls:

    POST /tokenize        {"prompt": str, "add_special_tokens": bool = true}, or vLLM's chat
                          form {"messages": [...], "tools", "add_generation_prompt": bool = true,
                          "continue_final_message": bool = false, "add_special_tokens": bool =
                          false}; either with "return_token_strs": bool = false
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [int, ...]} -> {"prompt": the decoded text}
    GET  /tokenizer_info  {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                          "model_max_length", "chat_template"} (null where the tokenizer has
                          none)
    GET  /v1/models/{id}  the served model's object; another id: 404, code model_not_found

The ids are those the completion routes are prompted with: a text prompt with the default
add_special_tokens is /v1/completions' prompt; messages with the generation prompt are
/v1/chat/completions' prompt (checked by the same parse_chat: the same 400s). `model` may be
sent and is ignored; any other key is a 400 naming it. The API key (when set) guards these
routes as it guards /v1 (engine.api.http.require_api_key). /tokenize and /detokenize parse and
(de)tokenize on a worker thread, never on the server's event loop.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from engine.api.http import model_object, parse_json, read_body
from engine.api.requests import ApiError, bad, parse_chat

PROMPT_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_KEYS = {"model", "messages", "tools", "add_generation_prompt", "continue_final_message",
             "add_special_tokens", "return_token_strs"}


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{key} must be a boolean, got {value!r:.50}", key)
    return value


def _object(body, keys: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in keys:
            raise bad(f"unsupported parameter {key!r}; this route takes "
                      f"{', '.join(sorted(keys))}", key)
    return body


def _chat_text(endpoint, body: dict) -> str:
    """The chat of a /tokenize body rendered to text (parse_chat's checks and 400s)."""
    call = parse_chat({"messages": body.get("messages"), "tools": body.get("tools")},
                      endpoint.limits)
    generation = _flag(body, "add_generation_prompt", True)
    continued = _flag(body, "continue_final_message", False)
    if endpoint.rules.problem:
        raise bad(f"messages cannot be rendered: {endpoint.rules.problem}", "messages")
    try:
        return endpoint.rules.tokenizer.apply_chat_template(
            call.messages, tools=call.tools, tokenize=False,
            add_generation_prompt=generation, continue_final_message=continued)
    except Exception as e:  # noqa: BLE001 - jinja raise_exception, or both flags true
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None


def tokenize(endpoint, body) -> dict:
    """A /tokenize body's reply (module docstring)."""
    chat = isinstance(body, dict) and "messages" in body
    body = _object(body, CHAT_KEYS if chat else PROMPT_KEYS)
    tokenizer = endpoint.rules.tokenizer
    if chat:
        text = _chat_text(endpoint, body)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad(f"prompt must be a string (or send messages), got "
                      f"{type(text).__name__}", "prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens",
                                                               not chat)))
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) \
        else None
    return {"count": len(ids), "max_model_len": endpoint.settings.max_context, "tokens": ids,
            "token_strs": strs}


def detokenize(endpoint, body) -> dict:
    """A /detokenize body's reply: {"prompt": the tokens decoded as they are}."""
    tokens = _object(body, {"model", "tokens"}).get("tokens")
    vocab = endpoint.rules.vocab_size
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": endpoint.rules.tokenizer.decode(tokens)}


def tokenizer_info(tokenizer) -> dict:
    """GET /tokenizer_info: the tokenizer's special tokens, class, length and chat template."""
    info = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = None if value is None else str(value)
    length = getattr(tokenizer, "model_max_length", None)
    info["model_max_length"] = length if isinstance(length, int) else None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):   # named templates: the default one renders chats
        template = template.get("default")
    info["chat_template"] = template if isinstance(template, str) and template else None
    return info


def add_tokenizer_routes(app: FastAPI, endpoint) -> None:
    """Register the module's routes on `app` for a ServeEndpoint `endpoint` (its rules,
    limits, settings and max_body_bytes)."""
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        raw = await read_body(request, endpoint.max_body_bytes, endpoint.body_limit)
        return await asyncio.to_thread(lambda: tokenize(endpoint, parse_json(raw)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        raw = await read_body(request, endpoint.max_body_bytes, endpoint.body_limit)
        return await asyncio.to_thread(lambda: detokenize(endpoint, parse_json(raw)))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        return tokenizer_info(endpoint.rules.tokenizer)

    @app.get("/v1/models/{model_id:path}")
    async def model_route(model_id: str) -> dict:
        if model_id != endpoint.limits.model:
            raise ApiError(404, f"The model {model_id!r} does not exist: this server serves "
                           f"{endpoint.limits.model!r}", "model", code="model_not_found")
        return model_object(endpoint.limits)
