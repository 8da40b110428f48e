"""HF <-> Megatron-Core bridge for the families in models.families (Llama, Qwen2, Qwen3, Qwen3-MoE).

Imports flow engine -> models -> parallel.
"""
import parallel  # noqa: E402,F401  (installs parallel.cpu_runtime's import hook first)
