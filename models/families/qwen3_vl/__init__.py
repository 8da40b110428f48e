"""Qwen3-VL (Qwen3VLForConditionalGeneration): its text model (`qwen3_vl_text`: Qwen3's
decoder with interleaved M-RoPE and deepstack) and the conditional-generation wrapper
(`qwen3_vl`), read as the text model (models.hf.conditional) with its vision tower in the
trainer (models.vision). `family.py` holds both declarations.
"""
