"""vLLM itself, imported at its first use: only an engine's owner pays the import (seconds on a
CPU host), while every rank imports the modules of engine.generation.vllm for their flags and
config checks, on hosts without vLLM too. Every module of the backend reaches vLLM's classes
through `vllm_module()` (the one import of vLLM here; the LoRA request class is imported where
an adapter is served, engine.generation.vllm.adapter).
"""
from __future__ import annotations


def vllm_module():
    """The `vllm` package (imported at the first call, then sys.modules' copy): its top-level
    names (LLM, SamplingParams, TokensPrompt) and the submodules its import loads (platforms,
    sampling_params, imported here: a bare `import vllm` loads neither, and `serve --backend
    vllm` reaches `platforms` before anything else imported it)."""
    import vllm   # only an engine's owner pays vLLM's import (module docstring)
    import vllm.platforms  # noqa: F401 - the submodules the backend reaches by attribute
    import vllm.sampling_params  # noqa: F401
    return vllm
