"""Quantized weight formats as models are published: block-scaled FP8 (`fp8.py`; DeepSeek-V3,
Kimi-K2), MXFP4 (`mxfp4.py`; gpt-oss experts) and the `quantization_config.quant_method`
dispatch (`quantized.py`: which tensors stand for a weight, exact dequantization, the same
quantization for export and weight sync). Tensor math only: no checkpoint I/O (models.hf), no
family (a family declares the methods it accepts).

May import: models.families.base (the errors and config reading helpers).
"""
