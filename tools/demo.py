"""The CPU demos' local models, data and evaluation (recipes/*_demo.sh); nothing is downloaded.

    python -m tools.demo assets --out runs/demo_assets         (recipes/cpu_demo.sh)
        OUT/model/ (tiny random Qwen3, hidden 128, 4 heads of 32 dims), OUT/sft_train.jsonl,
        OUT/sft_eval.jsonl (chat rows "what is a + b ?" -> "the answer is c"),
        OUT/rl_prompts.jsonl ({"prompt", "answer"}) and OUT/dpo_train.jsonl, OUT/dpo_eval.jsonl
        (recipes/dpo_cpu_demo.sh: preference pairs, chosen "the answer is c", rejected "c is the
        answer"; the eval pairs' prompts are not in the training pairs), OUT/kto_train.jsonl,
        OUT/kto_eval.jsonl (recipes/kto_cpu_demo.sh: the same pairs unpaired, "the answer is c"
        desirable, "c is the answer" undesirable; conversational rows, the eval rows as text)
    python -m tools.demo model DIR [--hidden H] [--layers L] [--intermediate I] [--head-dim D]
        [--seed S]
        a tiny random Qwen3 (H / D heads of D dims, default 32, and 2 KV heads: hidden 64 has 2
        heads, 128 has 4; 1 KV head where H / D is odd) with the 200-token word-level tokenizer
        of tools/tiny_models.py (every addition-demo model shares it); 32 is the smallest head
        dim vLLM's CPU attention runs, so the default serves on every backend, and `--head-dim
        16` is refused by `serve --backend vllm` and rollout.backend=vllm;
        --eos-prone: instead the partial-rollout tests' Qwen3 (init 0.2, its end-of-turn
        embedding scaled by 2.5: tools.tiny_models.eos_prone_model; H / D heads, an even number)
        whose sampled replies end at spread lengths, so partial rollouts cut some and carry them
        (docs/async-rl.md; `--hidden 128 --intermediate 256` is tests/test_rl_partial_vllm.py's);
        --mtp: instead a tiny random GLM-4.5 MoE with a multi-token-prediction layer
        (docs/mtp.md's CPU example)
    python -m tools.demo addition-data WORK
        WORK/sft.jsonl ("what is a plus b ?" -> "a+b") and WORK/rl.jsonl (the same prompts with
        "answer"), single-digit a and b: 100 rows each
    python -m tools.demo rm-data WORK
        WORK/rm_sft.jsonl (each addition prompt answered "c" and "the answer is c"),
        WORK/rl.jsonl, WORK/rm_train.jsonl (80 pairs) and WORK/rm_eval.jsonl (20 pairs on other
        prompts): chosen "the answer is c", rejected "c" (recipes/rm_cpu_demo.sh)
    python -m tools.demo tools-data WORK
        WORK/init/ (tiny random Qwen3 with a character-level tokenizer whose chat template renders
        tools and <tool_call> blocks the Qwen way), WORK/sft.jsonl (2,000 tool-use conversations
        "What is 37*48?" -> calculate("37*48") -> 1776 -> "1776") and WORK/rl.jsonl (2,000 other
        products with "answer")
    python -m tools.demo counting-data WORK
        the image demo (recipes/vlm_cpu_demo.sh, tools/demo_images.py): WORK/init/ (a tiny
        Qwen3-VL), pictures of 1 to 4 squares, WORK/sft.jsonl and WORK/rl.jsonl (how many?)
    python -m tools.demo counting-evaluate --data WORK/rl.jsonl --model NAME=DIR [...] [--limit N]
        greedy counts of each HF model for the first N pictures, and the accuracy of each
    python -m tools.demo evaluate --data WORK/rl.jsonl --model NAME=DIR [--model NAME=DIR ...]
        [--limit N] [--max-new-tokens T] [--tools] [--show K]
        greedy answers of each HF model (transformers' generate) to the first N prompts, scored
        by the built-in math reward; --tools runs the calculator tool between turns (at most 3
        turns, the RL demo's env.max_turns). Prints K answers per model and the accuracy of each.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tools/demo.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.demo_evaluate import evaluate  # noqa: E402
from tools.demo_images import evaluate_counting, make_counting_data  # noqa: E402
from tools.tiny_models import eos_prone_model, tiny_mtp_model  # noqa: E402

# A compact Qwen-style template: tools in a short system turn, tool calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn (the tool-call format detected: "hermes").
_NL = "{{ '\\n' }}"
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system" + _NL + "tools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}<|im_end|>" + _NL + "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant" + _NL +
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \""
    "{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>" + _NL +
    "{%- elif m.role == 'tool' %}<|im_start|>user" + _NL +
    "<tool_response>{{ m.content }}</tool_response><|im_end|>" + _NL +
    "{%- else %}<|im_start|>{{ m.role }}" + _NL + "{{ m.content }}<|im_end|>" + _NL +
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + _NL + "{%- endif %}")
MAX_TOOL_TURNS = 3
# the demo models' head dim: the smallest vLLM's CPU attention runs
# (engine.generation.vllm.attention.CPU_HEAD_DIMS), so every demo serves on every backend
DEMO_HEAD_DIM = 32


def write_jsonl(path: Path | str, rows: list[dict]) -> str:
    """Write `rows` as JSON lines; returns "PATH (N rows)" for the command's summary."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return f"{path} ({len(rows)} rows)"


def chat_row(a: int, b: int) -> dict:
    """One SFT chat row of the CPU demo: "what is a + b ?" -> "the answer is a+b"."""
    return {"messages": [{"role": "user", "content": f"what is {a} + {b} ?"},
                         {"role": "assistant", "content": f"the answer is {a + b}"}]}


def preference_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """Preference rows (explicit prompt, conversational): chosen "the answer is c", rejected the
    same sum in the other word order, "c is the answer" (a preference a tiny model can learn
    from a few hundred pairs and carry to prompts it never saw)."""
    return [{"prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}],
             "chosen": [{"role": "assistant", "content": f"the answer is {a + b}"}],
             "rejected": [{"role": "assistant", "content": f"{a + b} is the answer"}]}
            for a, b in pairs]


def unpaired_rows(pairs: list[tuple[int, int]], text: bool = False) -> list[dict]:
    """KTO's unpaired rows of `pairs` (TRL's unpaired format): each prompt twice, with
    "the answer is c" (label true) and "c is the answer" (label false); conversational, or
    standard text with `text`."""
    rows = []
    for a, b in pairs:
        prompt = f"what is {a} + {b} ?"
        for completion, label in ((f"the answer is {a + b}", True),
                                  (f"{a + b} is the answer", False)):
            if text:
                rows.append({"prompt": prompt, "completion": completion, "label": label})
            else:
                rows.append({"prompt": [{"role": "user", "content": prompt}],
                             "completion": [{"role": "assistant", "content": completion}],
                             "label": label})
    return rows


def make_assets(out: Path, seed: int = 0) -> str:
    """recipes/cpu_demo.sh's model and data in `out` (module docstring); returns a summary."""
    from tools.tiny_models import build_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    build_tiny_model(str(out / "model"), "qwen3", vocab_size=256, hidden=128, layers=4,
                     heads=4, kv_heads=2, intermediate=256, seed=seed, head_dim=DEMO_HEAD_DIM)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    eval_pairs, train_pairs = pairs[:20], pairs[20:]
    write_jsonl(out / "sft_train.jsonl", [chat_row(a, b) for a, b in train_pairs * 4])
    write_jsonl(out / "sft_eval.jsonl", [chat_row(a, b) for a, b in eval_pairs])
    write_jsonl(out / "rl_prompts.jsonl",
                [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a, b in pairs])
    write_jsonl(out / "dpo_train.jsonl", preference_rows(train_pairs))
    write_jsonl(out / "dpo_eval.jsonl", preference_rows(eval_pairs))
    kto_train = unpaired_rows(train_pairs)
    random.Random(seed + 1).shuffle(kto_train)   # desirable and undesirable rows mixed
    write_jsonl(out / "kto_train.jsonl", kto_train)
    write_jsonl(out / "kto_eval.jsonl", unpaired_rows(eval_pairs, text=True))
    return (f"demo assets in {out}: model/, sft_train.jsonl ({len(train_pairs) * 4} rows), "
            f"sft_eval.jsonl ({len(eval_pairs)} rows), rl_prompts.jsonl ({len(pairs)} rows), "
            f"dpo_train.jsonl ({len(train_pairs)} pairs), dpo_eval.jsonl "
            f"({len(eval_pairs)} pairs), kto_train.jsonl ({2 * len(train_pairs)} rows), "
            f"kto_eval.jsonl ({2 * len(eval_pairs)} rows)")


def demo_heads(hidden: int, head_dim: int) -> tuple[int, int]:
    """(heads, KV heads) of a `demo model` of width `hidden`: hidden / head_dim heads (so
    heads x head_dim = hidden), 2 KV heads (TP2 splits them) where that count is even, else 1.
    ValueError naming --hidden and --head-dim where head_dim does not divide hidden."""
    if head_dim <= 0 or hidden % head_dim:
        raise ValueError(f"--hidden {hidden} is not a multiple of --head-dim {head_dim} (the "
                         f"model has hidden / head dim heads; {DEMO_HEAD_DIM} is the default)")
    heads = hidden // head_dim
    return heads, 2 if heads % 2 == 0 else 1


def make_model(out: str, hidden: int, layers: int, intermediate: int, seed: int,
               head_dim: int = DEMO_HEAD_DIM) -> None:
    """`demo model`'s tiny random Qwen3 (module docstring) in `out`."""
    from tools.tiny_models import build_tiny_model

    heads, kv_heads = demo_heads(hidden, head_dim)
    build_tiny_model(out, "qwen3", vocab_size=200, hidden=hidden, layers=layers, heads=heads,
                     kv_heads=kv_heads, intermediate=intermediate, seed=seed, head_dim=head_dim)


def make_addition_data(work: Path) -> list[str]:
    """sft.jsonl and rl.jsonl of single-digit addition in `work`; returns what was written."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    return [write_jsonl(work / "sft.jsonl", [{"prompt": f"what is {a} plus {b} ?",
                                              "response": str(a + b)} for a, b in pairs]),
            write_jsonl(work / "rl.jsonl", [{"prompt": f"what is {a} plus {b} ?",
                                             "answer": a + b} for a, b in pairs])]


def make_rm_data(work: Path) -> list[str]:
    """The reward-model demo's rows (recipes/rm_cpu_demo.sh), single-digit addition with two
    answer formats: rm_sft.jsonl (every prompt answered "c" and "the answer is c": the SFT'd
    policy samples both), rl.jsonl (the prompts with "answer"), rm_train.jsonl (80 prompts) and
    rm_eval.jsonl (the other 20): preference pairs, chosen "the answer is c", rejected "c".
    Returns what was written."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    q = "what is {} plus {} ?"
    written = [write_jsonl(work / "rm_sft.jsonl", [
        {"prompt": q.format(a, b), "response": r} for a, b in pairs
        for r in (str(a + b), f"the answer is {a + b}")]),
        write_jsonl(work / "rl.jsonl", [{"prompt": q.format(a, b), "answer": a + b}
                                        for a, b in pairs])]

    def rows(prompts):
        return [{"prompt": [{"role": "user", "content": q.format(a, b)}],
                 "chosen": [{"role": "assistant", "content": f"the answer is {a + b}"}],
                 "rejected": [{"role": "assistant", "content": str(a + b)}]}
                for a, b in prompts]

    return written + [write_jsonl(work / "rm_train.jsonl", rows(pairs[:80])),
                      write_jsonl(work / "rm_eval.jsonl", rows(pairs[80:]))]


def calculator_tools() -> list[dict]:
    """The JSON schema of engine.rl.env.example_tools.calculate, as the chat template sees it."""
    from engine.rl.env.example_tools import calculate
    from engine.rl.env.tool_schema import tool_schema

    return [tool_schema(calculate)]


def make_tools_data(work: Path) -> list[str]:
    """The tools demo's model (work/init) and multiplication rows; returns what was written."""
    from tools.char_tokenizer import build_char_tokenizer
    from tools.tiny_models import build_tiny_model

    # Qwen2.5's special and added tokens (<|im_end|> ends a turn), the compact template above
    tok = build_char_tokenizer(str(work / "init"), "qwen2.5", template=TOOLS_TEMPLATE)
    build_tiny_model(str(work / "init"), "qwen3", vocab_size=len(tok), hidden=128, layers=2,
                     heads=4, kv_heads=2, intermediate=256, seed=0, tokenizer=False,
                     head_dim=DEMO_HEAD_DIM,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tools = calculator_tools()
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    rows = []
    for a, b in pairs[:2000]:
        call = {"type": "function", "function": {"name": "calculate",
                                                 "arguments": {"expression": f"{a}*{b}"}}}
        rows.append({"tools": tools, "messages": [
            {"role": "user", "content": f"What is {a}*{b}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]})
    return [f"{work / 'init'} (a tiny random Qwen3 and its character tokenizer)",
            write_jsonl(work / "sft.jsonl", rows),
            write_jsonl(work / "rl.jsonl", [{"prompt": f"What is {a}*{b}?", "answer": a * b}
                                            for a, b in pairs[2000:4000]])]


def _model_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--model {text!r}: expected NAME=DIR")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    """`tools.demo`'s parser: every subcommand and option with its meaning."""
    head, tail = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(description=head, epilog=tail,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("assets", help="recipes/cpu_demo.sh's model and data")
    p.add_argument("--out", default="runs/demo_assets",
                   help="folder of the model and the data files (default: runs/demo_assets)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialization seed")
    p = sub.add_parser("model", help="a tiny random Qwen3 with the word-level tokenizer")
    p.add_argument("dir", help="folder to write the model, its config and tokenizer to")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--intermediate", type=int, default=128,
                   help="MLP intermediate size (default: 128)")
    p.add_argument("--head-dim", type=int, default=DEMO_HEAD_DIM,
                   help="dims of each of the hidden / D heads (vLLM's CPU attention needs 32 "
                   "or more)")
    p.add_argument("--seed", type=int, default=0, help="initialization seed (default: 0)")
    p.add_argument("--eos-prone", action="store_true",
                   help="replies that end at spread lengths (the partial-rollout tests' model)")
    p.add_argument("--mtp", action="store_true", help="a tiny GLM-4.5 MoE with an MTP layer")
    for name, meaning in (("addition-data", "single-digit addition, SFT and RL rows"),
                          ("rm-data", "the reward-model demo's SFT rows, RL prompts and pairs"),
                          ("tools-data", "the tools demo's model and multiplication data"),
                          ("counting-data", "the image demo's model, pictures and rows")):
        sub.add_parser(name, help=meaning).add_argument(
            "work", help="folder to write the files to (made when missing)")
    p = sub.add_parser("counting-evaluate", help="greedy counting accuracy of HF models")
    p.add_argument("--data", required=True, help="the counting demo's RL rows (WORK/rl.jsonl)")
    p.add_argument("--model", type=_model_arg, action="append", required=True,
                   help="NAME=DIR: a HF model folder and its name in the output (repeat to "
                        "compare)")
    p.add_argument("--limit", type=int, default=100,
                   help="the first N rows are asked (default: 100)")
    p = sub.add_parser("evaluate", help="greedy accuracy of HF models on RL prompts")
    p.add_argument("--data", required=True,
                   help="RL prompt rows ({\"prompt\", \"answer\"} per line, e.g. WORK/rl.jsonl)")
    p.add_argument("--model", type=_model_arg, action="append", required=True,
                   help="NAME=DIR: a HF model folder and its name in the output (repeat to "
                        "compare)")
    p.add_argument("--limit", type=int, default=100,
                   help="the first N prompts are asked (default: 100)")
    p.add_argument("--max-new-tokens", type=int, default=8,
                   help="tokens of each greedy reply, per turn (default: 8)")
    p.add_argument("--tools", action="store_true",
                   help=f"run the calculator between turns (at most {MAX_TOOL_TURNS} turns)")
    p.add_argument("--show", type=int, default=3,
                   help="replies printed per model, the first K prompts' (default: 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tools.bench.common import quiet_libraries

    quiet_libraries()
    if args.command == "assets":
        print(make_assets(Path(args.out), args.seed))
    elif args.command == "model":
        try:
            heads, kv_heads = demo_heads(args.hidden, args.head_dim)
        except ValueError as e:
            parser.error(str(e))
        if args.eos_prone and kv_heads != 2:
            parser.error(f"--eos-prone needs an even number of heads (2 KV heads): --hidden "
                         f"{args.hidden} / --head-dim {args.head_dim} is {heads}")
        if args.mtp:
            tiny_mtp_model(args.dir)
        elif args.eos_prone:
            eos_prone_model(args.dir, hidden=args.hidden, layers=args.layers, heads=heads,
                            intermediate=args.intermediate, head_dim=args.head_dim)
        else:
            make_model(args.dir, args.hidden, args.layers, args.intermediate, args.seed,
                       args.head_dim)
        kind = ("a tiny GLM-4.5 MoE with an MTP layer" if args.mtp else
                f"a tiny {'eos-prone' if args.eos_prone else 'random'} Qwen3 (hidden "
                f"{args.hidden}, layers {args.layers}) with {heads} head"
                f"{'s' * (heads != 1)} of {args.head_dim} dims")
        print(f"wrote {args.dir}: {kind}, its config and tokenizer")
    elif args.command in ("addition-data", "rm-data", "tools-data"):
        written = {"addition-data": make_addition_data, "rm-data": make_rm_data,
                   "tools-data": make_tools_data}[args.command](Path(args.work))
        print("wrote " + ", ".join(written))
    elif args.command == "counting-data":
        print(make_counting_data(Path(args.work)))
    elif args.command == "counting-evaluate":
        evaluate_counting(args.model, args.data, args.limit)
    else:
        evaluate(args.model, args.data, args.limit, args.max_new_tokens,
                 calculator_tools() if args.tools else None, args.show, MAX_TOOL_TURNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
