"""docs/getting-started.md cannot drift from the command: its console-command table has a row
for every subcommand of `megatron-sft-engine` (tools.cli.SUBCOMMANDS) and no other, its
`validate`, `convert` and `demo` rows list exactly the choices those commands take (read from
their own --help), and every CPU demo script in recipes/ is named in its demo list. Negative
controls: a table without a row, and a row with a stale choice list, are reported."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from tools import cli

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"
HELPERS = {"rl_demo_common.sh", "demo_args.sh"}   # sourced by the demos, not run


def table_rows(text: str) -> dict[str, str]:
    """{first word of the first cell's code span: that first cell} of the console table."""
    section = text.split("## The console command", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)`", line)
        if m:
            rows.setdefault(m.group(1).split()[0], m.group(1))
    return rows


def choices(cell: str) -> list[str]:
    """The {a,b,c} list of a table cell or a usage line."""
    m = re.search(r"\{([a-z0-9,-]+)\}", cell)
    return m.group(1).split(",") if m else []


def problems(text: str, wanted: dict[str, list[str]]) -> list[str]:
    """What the table of `text` lacks: subcommands (keys of `wanted`) without a row, rows of
    no subcommand, and rows whose {choices} differ from `wanted`'s non-empty lists."""
    rows = table_rows(text)
    out = [f"no row for `{n}`" for n in wanted if n not in rows]
    out += [f"a row for `{n}`, which is no subcommand" for n in rows if n not in wanted]
    out += [f"`{n}` lists {choices(rows[n])}, the command takes {c}"
            for n, c in wanted.items() if c and n in rows and choices(rows[n]) != c]
    return out


def _help_choices(main, argv: list[str], capsys, monkeypatch) -> list[str]:
    monkeypatch.setattr(sys, "argv", ["megatron-sft-engine"])
    try:
        main(argv)
    except SystemExit:   # argparse's --help
        pass
    return choices(capsys.readouterr().out)


def test_console_table_matches_the_command(capsys, monkeypatch):
    from tools.convert import main as convert_main
    from tools.demo import main as demo_main

    wanted = {name: [] for name in cli.SUBCOMMANDS}
    wanted["validate"] = list(cli.ENGINES)
    wanted["convert"] = _help_choices(convert_main, ["--help"], capsys, monkeypatch)
    wanted["demo"] = _help_choices(demo_main, ["--help"], capsys, monkeypatch)
    assert "verify" in wanted["convert"] and "rm-data" in wanted["demo"]
    assert problems(PAGE.read_text(), wanted) == []


def test_the_check_finds_a_missing_row_and_a_stale_list():
    text = ("## The console command\n\n| subcommand | a | b |\n|---|---|---|\n"
            "| `sft [x]` | a | b |\n| `validate {sft,rl} --config F` | a | b |\n"
            "| `train` | a | b |\n\n## Next\n| `kto` | x | y |\n")
    found = problems(text, {"sft": [], "kto": [], "validate": ["sft", "rl", "dpo"]})
    assert found == ["no row for `kto`", "a row for `train`, which is no subcommand",
                     "`validate` lists ['sft', 'rl'], the command takes ['sft', 'rl', 'dpo']"]


def test_every_cpu_demo_is_listed():
    text = PAGE.read_text()
    demos = sorted(p.name for p in (ROOT / "recipes").glob("*demo*.sh")
                   if p.name not in HELPERS)
    assert len(demos) >= 9
    assert [d for d in demos if f"bash recipes/{d}" not in text] == []


def test_demo_model_eos_prone_is_the_partial_tests_model(tmp_path):
    """`tools.demo model --eos-prone` (docs/async-rl.md's partial-rollout example) writes
    tools.tiny_models.eos_prone_model: the plain build with the end-of-turn row (id 3) scaled by
    2.5 and every other tensor equal. Control: the plain demo model differs from it."""
    from safetensors.torch import load_file

    from tools.demo import main
    from tools.tiny_models import build_tiny_model

    demo, plain = str(tmp_path / "demo"), str(tmp_path / "plain")
    main(["model", demo, "--eos-prone", "--layers", "1"])
    build_tiny_model(plain, "qwen3", hidden=64, layers=1, heads=2, kv_heads=2, seed=0,
                     initializer_range=0.2, intermediate=128, head_dim=32)
    got, ref = (load_file(f"{d}/model.safetensors") for d in (demo, plain))
    assert got.keys() == ref.keys()
    row = "model.embed_tokens.weight"
    assert torch.equal(got[row][3], 2.5 * ref[row][3]) and not torch.equal(got[row][3], ref[row][3])
    assert all(torch.equal(got[k], ref[k]) for k in ref if k != row)
    assert torch.equal(got[row][4:], ref[row][4:])
    main(["model", str(tmp_path / "default"), "--layers", "1"])
    default = load_file(f"{tmp_path}/default/model.safetensors")
    assert not torch.equal(default[row], got[row])
