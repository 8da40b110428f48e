"""Markdown table of the communication plan of the shipped H100 recipes at several node counts.

    python tools/comm_table.py [--nodes 2,4,8]

For each recipe in recipes/sft and recipes/rl and each node count (8 GPUs per node) it runs the
same `--validate --json` code path as `python -m engine.sft|engine.rl --config R --validate
--json --nodes N` and prints GB (1e9 bytes) handed to collectives per GPU per optimizer step by
kind (models.estimate.comm), the busiest pipeline stage. Layouts a recipe does not allow at a
node count (e.g. dp not dividing) print their problem instead. Derived numbers, not measured.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLUMNS = ("dp_grad_reduce", "dp_param_all_gather", "tp_sp", "pp_p2p", "cp_exchange",
           "ep_all_to_all")


def run_validate(recipe: str, nodes: int) -> dict:
    """The --validate --json object of `recipe` on `nodes` x 8 GPUs."""
    from engine.config.recipe_validation import validate_main
    from engine.rl.recipe_check import rl_validate_main

    main = rl_validate_main if "/rl/" in recipe else validate_main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["--config", recipe, "--validate", "--json", "--nodes", str(nodes),
              "--gpus-per-node", "8"])
    return json.loads(out.getvalue())


def table(nodes_list: list[int]) -> str:
    head = ("| recipe | nodes | " + " | ".join(COLUMNS) + " | total | weight sync / engine |")
    lines = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for recipe in sorted(glob.glob("recipes/sft/*.yaml")) + sorted(glob.glob("recipes/rl/*.yaml")):
        for nodes in nodes_list:
            data = run_validate(recipe, nodes)
            name = os.path.relpath(recipe, "recipes")
            if "communication" not in data:
                lines.append(f"| {name} | {nodes} | not valid: "
                             f"{'; '.join(data['problems'])[:120]} |")
                continue
            comm = data["communication"]
            cells = " | ".join(f"{comm['per_gpu'][k] / 1e9:.1f}" for k in COLUMNS)
            sync = comm.get("weight_sync")
            sync_text = f"{sync['bytes_per_engine'] / 1e9:.1f}" if sync else "-"
            lines.append(f"| {name} | {nodes} | {cells} | {comm['total_per_gpu'] / 1e9:.1f} | "
                         f"{sync_text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,4,8")
    args = parser.parse_args()
    print(table([int(n) for n in args.nodes.split(",")]))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
