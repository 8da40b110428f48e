"""The run's environment for the checklist's report: GPU and driver (nvidia-smi, else torch),
Python, torch, transformers, megatron-core, peft and hydra-core versions, the CPU model and
core count, the commit (`environment`), and its one-line form (`environment_line`)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tools.bench.common import cpu_model


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def command_output(cmd: list[str]) -> str | None:
    """First line of `cmd`'s stdout, or None when it cannot run or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                             cwd=Path(__file__).resolve().parents[3])
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
        else None


def environment(cuda: bool) -> dict:
    """GPU, driver, Python and library versions, CPU, commit (None where unknown)."""
    gpu = driver = None
    smi = command_output(["nvidia-smi", "--query-gpu=name,driver_version",
                          "--format=csv,noheader"]) if cuda else None
    if smi and "," in smi:
        gpu, driver = (s.strip() for s in smi.rsplit(",", 1))
    if cuda and not gpu:
        import torch  # function-level: only on a CUDA host without nvidia-smi

        gpu = torch.cuda.get_device_name()
    libs = {name: version(name) for name in ("torch", "transformers", "megatron-core", "peft",
                                             "hydra-core")}
    if "torch" in sys.modules:  # torch.__version__ keeps the local tag (+cu130), metadata not
        libs["torch"] = sys.modules["torch"].__version__
    return {"gpu": gpu, "driver": driver, "python": platform.python_version(), **libs,
            "cpu": f"{cpu_model()} ({os.cpu_count()} cores)",
            "commit": command_output(["git", "describe", "--always", "--dirty"])}


def environment_line(env: dict) -> str:
    gpu = f"{env['gpu']} (driver {env['driver']})" if env.get("gpu") else "no GPU"
    libs = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "transformers", "megatron-core",
                                                    "peft", "hydra-core"))
    return (f"{gpu}; Python {env['python']}, {libs}; CPU {env['cpu']}; "
            f"commit {env.get('commit') or 'unknown'}")
