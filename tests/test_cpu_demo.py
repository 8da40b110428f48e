"""recipes/cpu_demo.sh as a user runs it, shortened to STEPS=2: its own megatron-sft-engine
commands, read from the script, run on the session's rank pools (the SFT on 4 ranks, TP2 x
DP2, as --nproc-per-node 4 starts it; the conversion on one) and the greedy evaluation in
this process. The demo leaves a Megatron checkpoint and a Hugging Face folder that
transformers loads, holding the trained weights, not the initial ones."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import torch

from tests.pool import REPO_ROOT

SCRIPT = REPO_ROOT / "recipes" / "cpu_demo.sh"


def demo_commands(out: str, steps: int) -> list[list[str]]:
    """The script's `megatron-sft-engine` commands (continuation lines joined, comments
    dropped) with $OUT, ${STEPS:-120} and "$@" substituted, without the program name."""
    text = re.sub(r"\\\n", " ", SCRIPT.read_text())
    commands = []
    for line in text.splitlines():
        line = (line.replace('"$@"', "").replace("${STEPS:-120}", str(steps))
                .replace("$OUT", out))
        words = shlex.split(line, comments=True)
        if words and words[0] == "megatron-sft-engine":
            commands.append(words[1:])
    return commands


def test_cpu_demo_leaves_a_checkpoint_and_an_hf_folder(pools, demo_assets, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.demo import main as demo_main

    out = str(tmp_path)
    os.symlink(demo_assets, tmp_path / "demo_assets")   # `demo assets`: the session's fixture
    commands = demo_commands(out, 2)
    assert [c[:2] for c in commands] == [["demo", "assets"], ["sft", "--nproc-per-node"],
                                         ["convert", "mcore-to-hf"], ["demo", "evaluate"]]
    assert commands[0][2:] == ["--out", f"{out}/demo_assets"]
    sft = commands[1]
    proc = pools.script(int(sft[2]), "-m", "engine.sft", *sft[3:], "logging.progress_bar=false",
                        timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cpu_demo" / "metrics.jsonl").is_file()
    assert (tmp_path / "cpu_demo" / "ckpt").is_dir()
    proc = pools.script(1, "tools/convert.py", *commands[2][1:], timeout=600)
    assert proc.returncode == 0, proc.stderr
    hf = tmp_path / "cpu_demo" / "hf"
    trained = AutoModelForCausalLM.from_pretrained(hf)
    initial = AutoModelForCausalLM.from_pretrained(demo_assets / "model")
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.apply_chat_template([{"role": "user", "content": "what is 1 + 2 ?"}],
                                   add_generation_prompt=True)
    a, b = trained.state_dict(), initial.state_dict()
    assert sorted(a) == sorted(b)
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-4, moved          # 2 steps at lr ~3e-4..3e-3 moved the weights
    capsys.readouterr()
    assert demo_main(commands[3][1:]) == 0
    assert "greedy accuracy of sft:" in capsys.readouterr().out
    assert torch.isfinite(trained(**tok("what is 1 + 2 ?", return_tensors="pt")).logits).all()
