"""Model families: what each HF architecture declares, as data (docs/extending.md).

One module per family (`llama.py`, ...) or one package when a family has more than a table
(`qwen3_5/`, `deepseek_v3/`); `base.py` (the `Family` base and its declared facts, with
defaults), `moe.py` (`MoeFamily`, `ExpertNaming`), `fields.py` (field rows several families
share), `registry.py` (every family by `model_type`: one line each) and `presets.py` (the
published shapes). Families hold declarations only: layer modules, mappings and cost formulas
live under models.layers, quantized formats under models.formats.

May import: models.families, models.layers (a layer kind's declaration mixin, field rows and
costs), models.formats (quantization method names), parallel. Not: models.hf, models.lora,
models.build, models.bridge, models.estimate, engine.
"""
