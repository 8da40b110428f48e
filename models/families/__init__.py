"""Model families: what each HF architecture declares, as data (docs/extending.md).

One module per family (`llama.py`, ...) or one package when a family has more than a table
(`qwen3_5/`, `deepseek_v3/`); `base.py` (the `Family` base and its declared facts, with
defaults: the vocabulary every package may read), `moe.py` (`MoeFamily`, `ExpertNaming`),
`sigmoid_routed.py` (the sigmoid-routed MoE base), `fields.py` (field rows several families
share), `registry.py` (every family by `model_type`: one line each, and queries over all),
`tensors.py` (the HF tensors a config's mapping consumes) and `presets.py` (the published
shapes). Families hold declarations only: layer modules, mappings and cost formulas live under
models.layers and read what a family declares; no code outside a family's module or package
names its model_type (tests/test_structure.py).

May import: models.families.base, models.formats (quantization method names). Not: models.hf,
models.layers, models.lora, models.build, models.bridge, models.estimate, engine; transformers and
megatron neither (engine.config.schema imports the presets at start-up), except where a family
registers a model_type with transformers (`Family.register_hf_classes`, called by models.hf).
"""
