"""Qwen3-VL and Qwen3-VL-MoE (Qwen3VL(Moe)ForConditionalGeneration): their text models
(`qwen3_vl_text`: Qwen3's decoder with interleaved M-RoPE and deepstack; `qwen3_vl_moe_text`:
the same with a sparse block in every layer, its experts fused on disk) and the
conditional-generation wrappers (`qwen3_vl`, `qwen3_vl_moe`), read as their text models
(models.hf.conditional) with the vision tower in the trainer (models.vision). `family.py`
holds the declarations, `presets.py` the published shapes.
"""
