"""DeepSeek-V3 / V3.1, Moonlight and Kimi-K2: the family (`family.py`), its config-field rows
(`fields.py`), Kimi-K2 as published (`kimi_k2.py`) and its transformers registration
(`kimi_k2_hf.py`, imported only through `KimiK2.register_hf_classes`). The MLA layers and the
sigmoid routing they declare are models.layers.mla and models.layers.sigmoid_routing.

May import: models.families (base, fields, moe, sigmoid_routed), models.formats.
"""
