"""Configuration: the hydra structured schema (schema.py), YAML/override loading (loading.py),
model and MoE settings derived from a config (model_settings.py, moe_settings.py), the parallel.*
keys and DDP overlap settings (parallel_settings.py), the checkpoint.* keys
(checkpoint_settings.py), the keys with a fixed set of values (choices.py: checked before the
heavy imports, listed by --help) and --help (help.py), the `--validate` recipe check
(recipe_validation.py, cli_flags.py) and its communication section (comm_report.py; the
counts, memory terms and communication plan themselves: models.estimate). Everything here runs
before any process group exists, and none of it imports megatron-core or transformers at import
(tests/test_imports.py): a recipe's `--validate` takes 1.4-1.8 s instead of 5.8-6.6 s (wall, the
2-core CPU host, idle); a model folder's config.json loads transformers' config classes when one
is read (schema.read_hf_config).

May import: engine.errors, engine.data (file specs), engine.training (loss modes, DP plan),
engine.checkpoint (resume checks), models. Entry points: schema.validate_sft,
recipe_validation.validate_main.
"""
