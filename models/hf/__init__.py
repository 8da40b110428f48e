"""The HF side of the bridge: config.json read through transformers' own config classes with
the families' field checks (`config.py`), safetensors folders and tokenizers (`io.py`,
`custom_code.py`), conditional-generation wrappers read as their text model
(`conditional.py`, driven by the families' declared `text_model_type`), tensors carried through
unchanged (`passthrough.py`), and the export and sync of quantized source checkpoints
(`quantized_export.py`, `quantized_stream.py`).

May import: models.families, models.families.base, models.formats.
"""
