"""The --model folder of `serve`, checked before anything heavy is imported (a clear error,
exit 2, naming what is missing).

A servable folder is local (nothing is downloaded) and holds config.json (a JSON object with
model_type), weights (*.safetensors, or a pytorch_model*.bin) and the tokenizer
(tokenizer.json or tokenizer_config.json); the engines then need an eos id somewhere (config,
generation config or tokenizer).
"""
from __future__ import annotations

import glob
import json
import os

BACKENDS = ("hf", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def folder_problem(path: str) -> str | None:
    """Why `path` cannot be served (one sentence naming --model), or None."""
    what = f"--model {path!r}"
    if not os.path.isdir(path):
        return (f"{what} is not a directory: give a local Hugging Face checkpoint folder "
                "(config.json, *.safetensors, the tokenizer); nothing is downloaded")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return f"{what} has no config.json: it is not a Hugging Face checkpoint folder"
    try:
        with open(config, encoding="utf-8") as f:
            parsed = json.load(f)
    except (OSError, ValueError) as e:
        return f"{what}: config.json does not parse as JSON: {e}"
    if not isinstance(parsed, dict) or not parsed.get("model_type"):
        return f"{what}: config.json has no model_type"
    if not any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHTS):
        return f"{what} has no weights ({' or '.join(WEIGHTS)})"
    if not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        return (f"{what} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): the endpoint "
                "renders chats and decodes replies with it")
    return None


def _text_config_value(path: str, key: str) -> int | None:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    value = (config.get("text_config") or {}).get(key) or config.get(key)
    return int(value) if value else None


def checkpoint_dtype(path: str) -> str | None:
    """The dtype the folder's weights are stored in, as transformers' dtype="auto" reads it
    (`--dtype auto`, so both backends serve the same dtype): config.json's dtype (or
    torch_dtype, of its text config first), else the dtype of the first floating-point tensor
    (float32, bfloat16 or float16) by name in the first weights file (the index's first shard
    by name, else the first *.safetensors by name), as transformers' get_state_dict_dtype over
    safetensors' sorted keys. Not the header's order: safetensors writes float32 tensors first,
    so a bfloat16 checkpoint holding one float32 buffer read as float32. One of DTYPES other
    than auto, or None when nothing says (a pytorch_model*.bin folder without a dtype)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    for scope in (config.get("text_config") or {}, config):
        value = scope.get("dtype") or scope.get("torch_dtype")
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPES[1:]:
            return value.removeprefix("torch.")
    for weights in _weight_files(path)[:1]:
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name in sorted(k for k in header if k != "__metadata__"):
            if header[name].get("dtype") in SAFETENSORS_DTYPES:
                return SAFETENSORS_DTYPES[header[name]["dtype"]]
    return None


def _weight_files(path: str) -> list[str]:
    """The folder's safetensors files in transformers' order: the shards its index names,
    sorted, else every *.safetensors file, sorted."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        return [os.path.join(path, name) for name in sorted(shards)]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def model_context(path: str) -> int | None:
    """The model's context length (max_position_embeddings of its text config), or None."""
    return _text_config_value(path, "max_position_embeddings")


def model_vocab(path: str) -> int | None:
    """The width of the model's logits (vocab_size of its text config), or None."""
    return _text_config_value(path, "vocab_size")
