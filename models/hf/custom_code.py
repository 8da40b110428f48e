"""HF folders that ship their own Python code (`auto_map` in config.json / tokenizer_config.json),
e.g. Kimi-K2: configuration_deepseek.py / modeling_deepseek.py for the model (never run here:
models.families.deepseek_v3.kimi_k2_hf) and tokenization_kimi.py (a tiktoken tokenizer) for the tokenizer.

- `custom_tokenizer(hf_dir)`: the tokenizer class the folder's own code defines when
  transformers would need that code to load the tokenizer (None: transformers has the class),
  decided as `AutoTokenizer.from_pretrained` decides it: tokenizer_config.json's
  `auto_map.AutoTokenizer` is used unless its `tokenizer_class` (or the config's model_type)
  names a class transformers has.
- `load_tokenizer(hf_dir, trust_remote_code)`: the engines' tokenizer load. With
  `trust_remote_code` (the config key model.trust_remote_code) the tokenizer's own code runs;
  the model config is still read with transformers' own classes, so the model's code never does.
- `code_files(hf_dir)`: the Python modules the folder's `auto_map` entries name, copied with the
  tokenizer files into checkpoints and exports (models.hf.io.copy_tokenizer_files), so an
  exported folder keeps the code its config.json and tokenizer_config.json refer to.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from models.families.registry import register_hf_classes

CODE_CONFIGS = ("config.json", "tokenizer_config.json")  # the files whose auto_map names code


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _tokenization_auto():
    """transformers' tokenizer auto module (AutoConfig, AutoTokenizer, TOKENIZER_MAPPING_NAMES,
    tokenizer_class_from_name), imported at first use: transformers takes seconds to import and
    the config checks (engine.config.tokenizer_settings, models.hf.io) import this module for
    every run, while only a folder with an auto_map or a tokenizer load needs it."""
    from transformers.models.auto import tokenization_auto  # heavy: at first use (docstring)
    return tokenization_auto


def _auto_tokenizer_refs(tokenizer_config: dict) -> list[str]:
    """The class references of tokenizer_config.json's auto_map for AutoTokenizer (the legacy
    list form too), e.g. ["tokenization_kimi.TikTokenTokenizer"]."""
    auto_map = tokenizer_config.get("auto_map")
    refs = auto_map if isinstance(auto_map, (list, tuple)) else (
        auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None)
    if isinstance(refs, str):
        refs = [refs]
    return [r for r in (refs or []) if isinstance(r, str)]


def _transformers_has(tokenizer_config: dict, config: dict) -> bool:
    auto = _tokenization_auto()
    name = tokenizer_config.get("tokenizer_class")
    if isinstance(name, str):
        base = name.removesuffix("Fast")
        if auto.tokenizer_class_from_name(base) or auto.tokenizer_class_from_name(base + "Fast"):
            return True
    return auto.TOKENIZER_MAPPING_NAMES.get(config.get("model_type")) is not None


def custom_tokenizer(hf_dir: str | os.PathLike) -> str | None:
    """The class reference (e.g. "tokenization_kimi.TikTokenTokenizer") of the folder's own
    tokenizer code when transformers needs that code to load its tokenizer; None otherwise."""
    path = Path(hf_dir)
    tokenizer_config = _json(path / "tokenizer_config.json")
    refs = _auto_tokenizer_refs(tokenizer_config)
    if not refs or _transformers_has(tokenizer_config, _json(path / "config.json")):
        return None
    return refs[-1]  # transformers prefers the fast class (second entry) when given


def load_tokenizer(hf_dir: str | os.PathLike, trust_remote_code: bool = False):
    """`AutoTokenizer.from_pretrained(hf_dir)`; with `trust_remote_code` the folder's own
    tokenizer code may run (the model config is read without its code), without it a folder
    that needs that code raises ValueError (transformers' refusal)."""
    auto = _tokenization_auto()
    if not trust_remote_code:  # False, not None: transformers would ask on stdin
        return auto.AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)
    register_hf_classes()  # e.g. a kimi_k2 config.json is read as DeepSeek-V3, not by its code
    config = auto.AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    return auto.AutoTokenizer.from_pretrained(hf_dir, config=config, trust_remote_code=True)


def code_files(hf_dir: str | os.PathLike) -> list[str]:
    """Names of the Python files in `hf_dir` that its config.json / tokenizer_config.json
    `auto_map` entries refer to ("module.Class" -> module.py; "repo--module.Class" refers to
    another repository and names no local file)."""
    path = Path(hf_dir)
    refs: list[str] = []
    for name in CODE_CONFIGS:
        auto_map = _json(path / name).get("auto_map")
        values = auto_map.values() if isinstance(auto_map, dict) else (auto_map or [])
        for value in values:
            refs += value if isinstance(value, (list, tuple)) else [value]
    modules = {r.rsplit(".", 1)[0] + ".py" for r in refs
               if isinstance(r, str) and "." in r and "--" not in r}
    return sorted(m for m in modules if (path / m).is_file())
