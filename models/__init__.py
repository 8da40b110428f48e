"""HF <-> Megatron-Core bridge for the families in models.families (Llama, Qwen2, Qwen3, Qwen3-MoE).

Imports flow engine -> models -> parallel.
"""
from parallel.cpu_runtime import skip_megatron_jit_on_cpu

skip_megatron_jit_on_cpu()  # before any megatron import of the process (idempotent)
