"""Configuration: the hydra structured schema (schema.py), YAML/override loading (loading.py),
model and MoE settings derived from a config (model_settings.py, moe_settings.py), the parallel.*
keys and DDP overlap settings (parallel_settings.py), the checkpoint.* keys
(checkpoint_settings.py), the keys with a fixed set of values (choices.py: checked before the
heavy imports, listed by --help) and --help (help.py), the `--validate` recipe check
(recipe_validation.py, cli_flags.py) and its communication section (comm_report.py; the
counts, memory terms and communication plan themselves: models.estimate). Everything here runs
before any process group exists.

May import: engine.errors, engine.data (file specs), engine.training (loss modes, DP plan),
engine.checkpoint (resume checks), models. Entry points: schema.validate_sft,
recipe_validation.validate_main.
"""
