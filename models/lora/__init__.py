"""LoRA: the spec, projections and initialisation (`slices.py`), adapters on Megatron's
tensor-parallel linears (`adapters.py`), where they go in a GPTModel (`sites.py`) and PEFT
adapter folders (`peft.py`). Which families get adapters is a
family's declared `lora` (read by engine.config.lora_settings).

May import: nothing else in models (torch and megatron only).
"""
