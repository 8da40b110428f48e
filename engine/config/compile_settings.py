"""The `train.compile` key: torch.compile per transformer layer (models.build.compile_layers).

A three-way switch spelled like the engine's others (`optim.fused`, `rollout.hf.static_cache`,
`rollout.hf.compile`, `rollout.vllm.enforce_eager`): null | true | false.

- null (the default): on when CUDA is available, off on a CPU host (inductor's C++ kernels
  take seconds per graph to build on a small CPU and do not make its steps faster); `auto`,
  this key's spelling before the switches shared one convention, still means null;
- `true`: on, on every host (the CPU host included: this is how the suite proves that the
  compiled layers equal eager at every layout, tests/test_train_compile.py);
- `false`: off; the model is megatron's eager model, unchanged.

YAML's `yes`/`no` and Python booleans read as true/false (OmegaConf turns a boolean given to
this string key into "True"/"False"); anything else is refused naming the key and the choices.
SFT, DPO, KTO, reward models (train.compile) and RL's policy and critic updates (train.compile
of the RL schema) read it.
"""
from __future__ import annotations

from typing import Any

import torch

CHOICES = ("null", "true", "false")
OLD_SPELLINGS = {"auto": "null", "none": "null"}   # `auto`: the key's spelling before null


def _normalized(value: Any) -> str | None:
    """The choice `value` stands for (None: not one)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        word = value.strip().lower()
        word = OLD_SPELLINGS.get(word, word)
        return word if word in CHOICES else None
    return None


def compile_problems(train_cfg: Any) -> list[str]:
    """train.compile not one of null, true, false (case-insensitive; booleans accepted; `auto`
    reads as null)."""
    value = getattr(train_cfg, "compile", None)
    if _normalized(value) is None:
        return [f"train.compile={value!r} is not valid; choose one of {', '.join(CHOICES)} "
                "(null: compiled with CUDA, eager on a CPU host; `auto` also means null)"]
    return []


def compile_on(train_cfg: Any, cuda: bool | None = None) -> bool:
    """train.compile resolved for this host (`cuda` None: torch.cuda.is_available())."""
    choice = _normalized(getattr(train_cfg, "compile", None))
    if choice is None:
        raise ValueError(compile_problems(train_cfg)[0])
    if choice == "null":
        return torch.cuda.is_available() if cuda is None else cuda
    return choice == "true"


def compile_overrides(cfg: Any) -> dict:
    """TrainEngine.build's `compile_layers` argument from train.compile (trained engines:
    SFT-shaped runs, the RL policy and critic; frozen reference models stay eager)."""
    return {"compile_layers": compile_on(cfg.train)}
