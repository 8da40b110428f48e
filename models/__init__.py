"""HF <-> Megatron-Core bridge for the Llama, Qwen2 and Qwen3 families.

Imports flow engine -> models -> parallel.
"""
