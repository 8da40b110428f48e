"""Every module of engine/, models/ and parallel/ imports cleanly as the first project import of
a fresh process (tests/import_each.py: one fork per module after the libraries are loaded), and
the check catches a broken import cycle (negative control); the config schema and the SFT, DPO
and RL `--validate` recipe checks import neither megatron-core nor transformers."""
from __future__ import annotations

import textwrap
from pathlib import Path

from tests.launch import python_json

TESTS = Path(__file__).resolve().parent


def test_every_module_imports_first_in_a_fresh_process():
    result = python_json(f"import sys; sys.argv = ['import_each']; "
                         f"sys.path.insert(0, {str(TESTS)!r}); "
                         "import import_each; sys.exit(import_each.main())")
    assert result["modules"] >= 200, result  # engine/, models/ and parallel/ were all found
    assert result["failures"] == {}, result["failures"]


HEAVY = ("megatron.core", "transformers")   # seconds of imports each (issue 90, item 15)


def test_config_checks_import_neither_megatron_nor_transformers():
    """`import engine.config.schema` (every CLI start, every --validate) and the SFT, DPO and RL
    `--validate` of a shipped recipe (preset shapes, no model folder) leave megatron-core and
    transformers unimported in a fresh process: a check of a config needs neither (their
    imports took 6.6 s per start). A model folder's config.json is read through transformers'
    config classes only when the config names one (engine.config.schema.read_hf_config).
    Negative control: before the lazy imports, schema alone imported both."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        heavy = {HEAVY!r}
        import engine.config.schema
        seen = {{"schema": [m for m in heavy if m in sys.modules]}}
        from engine.config.recipe_validation import validate_main
        from engine.dpo.recipe_check import main as dpo_main
        from engine.rl.recipe_check import rl_validate_main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            seen["codes"] = [validate_main(["--config", "recipes/sft/qwen3_30b_a3b_h100.yaml",
                                            "--validate"]),
                             dpo_main(["--config", "recipes/dpo/qwen3_8b_dpo_h100.yaml",
                                       "--validate"]),
                             rl_validate_main(["--config",
                                               "recipes/rl/qwen3_30b_a3b_grpo_h100.yaml",
                                               "--validate"])]
        seen["report"] = out.getvalue().count("recipe OK")
        seen["validate"] = [m for m in heavy if m in sys.modules]
        print(json.dumps(seen))
    """)
    seen = python_json(code)
    assert seen == {"schema": [], "codes": [0, 0, 0], "report": 3, "validate": []}, seen


# issue 42's broken cycle in miniature: quantized -> fam/__init__ -> reg -> quantized
CYCLE = {"root/__init__.py": "",
         "root/quantized.py": "from root.fam.base import ERRORS\nVALUE = 1\n",
         "root/fam/__init__.py": "from root.fam import reg\n",
         "root/fam/base.py": "ERRORS = ()\n",
         "root/fam/reg.py": "from root.quantized import VALUE\n"}


def write_cycle(where: Path) -> None:
    for name, text in CYCLE.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)


def test_a_broken_cycle_fails_its_first_import(tmp_path):
    """Negative control: in the miniature of the broken cycle, importing root.quantized first
    fails as `python -c "import models.quantized"` did; importing the package first works."""
    write_cycle(tmp_path)
    code = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(TESTS)!r}, {str(tmp_path)!r}]
        from import_each import import_each
        print(json.dumps(import_each(["root.quantized", "root.fam", "root.fam.base"])))
    """)
    failures = python_json(code)
    assert list(failures) == ["root.quantized"], failures
    assert "partially initialized module 'root.quantized'" in failures["root.quantized"]
