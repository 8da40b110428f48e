"""Reading and writing HF checkpoint folders (safetensors, config, tokenizer files)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from models.hf.custom_code import code_files, custom_tokenizer
from models.families.base import UnsupportedArchitectureError
from models.families.tensors import tensor_problems
from models.hf.conditional import text_names, text_view

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "generation_config.json",
                   "tiktoken.model",  # Kimi-K2's tokenizer code reads tiktoken.model
                   # the image / video processors of models that take images (docs/vlm.md)
                   "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")


class HFCheckpointError(FileNotFoundError):
    """An HF folder that cannot be read (missing, no config, no safetensors weights)."""


def read_config(hf_dir: str | os.PathLike) -> dict:
    """The folder's config.json as the engines read it: a conditional-generation wrapper's as
    its text model (models.hf.conditional.text_view), any other as stored."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise HFCheckpointError(f"HF model directory not found: {path}")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise HFCheckpointError(f"no config.json in HF model directory {path}")
    try:
        return text_view(json.loads(cfg.read_text()))
    except ValueError as e:
        raise HFCheckpointError(f"{cfg} is not valid JSON ({e})") from None


# Files that hold a tokenizer's vocabulary (any one suffices) and the places transformers reads
# a chat template from (besides the "chat_template" key of tokenizer_config.json).
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def _has_chat_template(path: Path) -> bool:
    if any((path / name).exists() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def sequence_classifier(config: dict) -> str | None:
    """The config's *ForSequenceClassification architecture (a reward model's), else None."""
    return next((a for a in config.get("architectures") or []
                 if a.endswith("ForSequenceClassification")), None)


def trunk_names(config: dict, names) -> list[str]:
    """The tensor names of a *ForSequenceClassification folder (a reward model) as the causal
    LM's mapping reads them: without its score head `score.weight` (models.bridge.reward_model
    reads it), with `lm_head.weight` for an untied trunk that has none (filled with the input
    embedding: models.bridge.critic.TrunkReader). Any other folder's names unchanged."""
    names = list(names)
    if sequence_classifier(config) is None:
        return names
    names = [n for n in names if n != "score.weight"]
    if not config.get("tie_word_embeddings") and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    return names


def weight_problems(hf_dir: str | os.PathLike) -> list[str]:
    """Safetensors weights present, holding exactly the tensors the bridge maps for the folder's
    config (models.families.tensor_problems: none left over, none missing; a sequence
    classifier's as its trunk plus its score head, `trunk_names`). Reads the config and the
    tensor names (file headers), no tensor data."""
    path = Path(hf_dir)
    if not ((path / "model.safetensors").is_file()
            or (path / "model.safetensors.index.json").is_file()):
        return ["no weights: model.safetensors or model.safetensors.index.json is missing"]
    try:
        config = read_config(path)
        return tensor_problems(config, trunk_names(config, SafetensorsReader(path).keys()))
    except UnsupportedArchitectureError:
        return []  # reported by the config check (models.hf.config)
    except (OSError, ValueError, KeyError) as e:
        return [f"cannot read the weights' tensor names ({e})"]


def training_dir_problems(hf_dir: str | os.PathLike, classifier_ok: bool = False) -> list[str]:
    """What an existing HF folder lacks for training from it (empty list: nothing): safetensors
    weights holding exactly the tensors the bridge maps (`weight_problems`), a tokenizer, and
    a chat template (every SFT row and RL prompt is rendered with it); with `classifier_ok`
    false (SFT, DPO, RL: they need an LM head) a *ForSequenceClassification folder is refused,
    naming engine.rm. Reads the file system only."""
    path = Path(hf_dir)
    problems = weight_problems(path)
    if not classifier_ok:
        try:
            arch = sequence_classifier(read_config(path))
        except HFCheckpointError:
            arch = None   # reported by the config check
        if arch is not None:
            problems.append(f"{arch} is a sequence classifier (a reward model: a score head, no "
                            "LM head); train it with `python -m engine.rm`, or give the causal "
                            "LM folder it was made from")
    if not any((path / name).is_file() for name in VOCAB_FILES) and \
            custom_tokenizer(path) is None:  # a tokenizer's own code reads its own files
        problems.append(f"no tokenizer: none of {', '.join(VOCAB_FILES)} is present")
    elif not _has_chat_template(path):
        problems.append("the tokenizer has no chat template (no chat_template.jinja and no "
                        "chat_template in tokenizer_config.json); use a chat/instruct model's "
                        "tokenizer files or add a template")
    return problems


class SafetensorsReader:
    """Lazy access to the tensors of an HF folder (single file or sharded with an index), named
    as the bridge reads them (a conditional-generation wrapper's text model as `model.*`:
    models.hf.conditional.text_names)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise HFCheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {self.dir}")
        self._handles = {f: safe_open(str(self.dir / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: files[0] for k in self._handles[files[0]].keys()}
        self._stored = text_names(self.dir, list(weight_map))  # bridge name -> stored name
        self._map = {n: weight_map[s] for n, s in self._stored.items()}

    def keys(self) -> list[str]:
        return list(self._map)

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def get(self, name: str) -> torch.Tensor:
        if name not in self._map:
            raise KeyError(f"tensor {name!r} not found in {self.dir}")
        return self._handles[self._map[name]].get_tensor(self._stored[name])

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """tensor[start:stop] along dim 0, reading only those rows (gpt-oss experts: one
        expert-parallel rank reads its own experts)."""
        if name not in self._map:
            raise KeyError(f"tensor {name!r} not found in {self.dir}")
        return self._handles[self._map[name]].get_slice(self._stored[name])[start:stop]

    def dtype_name(self, name: str) -> str:
        """The stored dtype of tensor `name` as safetensors spells it (e.g. "BF16",
        "F8_E4M3"), read from the file header."""
        if name not in self._map:
            raise KeyError(f"tensor {name!r} not found in {self.dir}")
        return self._handles[self._map[name]].get_slice(self._stored[name]).get_dtype()


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer/generation files present in `src` to `dst`, and the Python files its
    `auto_map` entries name (models.hf.custom_code.code_files); return their names."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES + tuple(code_files(src)):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
