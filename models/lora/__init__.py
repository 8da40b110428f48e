"""LoRA: what target names adapt as peft reads them, and its rank / alpha patterns
(`targets.py`, plain Python), the spec, projections and initialisation (`slices.py`), adapters
on Megatron's tensor-parallel linears (`adapters.py`) and their modes for a block of code (off,
the frozen reference, no dropout: `modes.py`), where they go in a GPTModel (`sites.py`) and
PEFT adapter folders (`peft.py`, `peft_experts.py`). Which families get
adapters, and how peft reads names on them, is a family's declared `lora`, `lora_targets`,
`lora_fused` (read by engine.config.lora_settings and engine.config.lora_family).

May import: nothing else in models (torch, megatron and parallel only).
"""
