"""`python -m tools.bench data [--quick]`: the data pipeline at scale (docs/benchmarks.md).

Generates a multi-turn chat file (20,000 rows of 1-3 turns, ~2,000 characters each; --quick:
500 rows), rendered by a character-level tokenizer with a chatml template without
{% generation %} tags (the linear span finder; one token per character, so ~40M tokens), then
measures:
- uncached rendering into the cache: rows/s and tokens/s by worker count (one build per count
  into a fresh cache folder) (the renderer this cache replaced was measured once, recorded in
  docs/benchmarks.md; it lives on only in tests/test_data_equivalence.py);
- time to the first optimizer step of `python -m engine.sft` with 2 ranks on a tiny model: from
  an empty cache, then cached (wall time of the whole launch, max_steps=1);
- RSS per rank at the end of that step with 2 ranks (cached) and, without --quick, 4 ranks:
  VmRSS (shared file pages of the mapped cache included), VmHWM, and RssAnon (private memory,
  what grows per rank); without --quick also with a 20x smaller file (the memory of a rank does
  not grow with the data).
Last stdout line: JSON with data_rows_per_s, data_tokens_per_s, first_step_s_uncached,
first_step_s_cached, rss_mb_per_rank (2 ranks, max over ranks) and the details.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

from tools.bench.common import (REPO_ROOT, BenchResult, Table, fmt, free_port, run_launch,
                          subprocess_env)

WORDS = ["the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for",
         "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or",
         "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your",
         "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their",
         "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so",
         "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two",
         "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than",
         "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down",
         "day", "did", "get", "come", "made", "may", "part", "42", "3.14", "x = y + 1", "?"]
FULL_ROWS, QUICK_ROWS = 20_000, 500


def _text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def generate_chat_file(path: str, rows: int, seed: int = 0) -> int:
    """Write `rows` OpenAI-format chats of 1-3 turns (optional system prompt) to `path`;
    returns the number of content characters."""
    rng = random.Random(seed)
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": _text(rng, 80)})
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": _text(rng, rng.randint(150, 450))})
                messages.append({"role": "assistant",
                                 "content": _text(rng, rng.randint(450, 950))})
            total += sum(len(m["content"]) for m in messages)
            f.write(json.dumps({"messages": messages}) + "\n")
    return total


def _char_model(folder: str) -> str:
    """A tiny Qwen3 (hidden 64, 2 layers) whose tokenizer is the character-level chatml one."""
    from tools.char_tokenizer import build_char_tokenizer
    from tools.tiny_models import build_tiny_model

    tok = build_char_tokenizer(None, "chatml")
    model = build_tiny_model(folder, "qwen3", vocab_size=128, hidden=64, layers=2, heads=4,
                             kv_heads=2, intermediate=128, tokenizer=False)
    tok.save_pretrained(model)
    if len(tok) > 128:
        raise AssertionError(f"char tokenizer has {len(tok)} ids, model vocab 128")
    return model


def _build_rate(path: str, tokenizer, workers: int, cache_dir: str) -> dict:
    from engine.data.datasets import load_sft_dataset

    t0 = time.perf_counter()
    ds = load_sft_dataset([path], tokenizer, 8192, cache_dir=cache_dir, num_workers=workers)
    seconds = time.perf_counter() - t0
    tokens = int(ds.lengths.sum()) + len(ds)
    return {"workers": workers, "seconds": seconds, "rows": ds.stats["rows"],
            "tokens": tokens, "rows_per_s": ds.stats["rows"] / seconds,
            "tokens_per_s": tokens / seconds}


RANK_WRAPPER = """
import json, os, sys
from engine.sft.__main__ import main
code = main(sys.argv[1:])
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
mb = lambda k: int(status[k].split()[0]) / 1024 if k in status else None
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["BENCH_RSS_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "rss_mb": mb("VmRSS"), "hwm_mb": mb("VmHWM"),
               "anon_mb": mb("RssAnon"), "file_mb": mb("RssFile")}, f)
sys.exit(code)
"""


def _sft_launch(model: str, data: str, cache_dir: str, ranks: int, log_dir: str,
                timeout_s: int = 900) -> dict:
    """Wall time of a max_steps=1 SFT launch with `ranks` gloo ranks and every rank's RSS."""
    args = [f"model.hf_path={model}", f"data.train_files=[{data}]", "train.seq_length=4096",
            f"train.global_batch_size={2 * ranks}", "train.micro_batch_size=1",
            "train.max_steps=1", "optim.schedule=constant", "logging.progress_bar=false",
            f"logging.dir={log_dir}", f"data.cache_dir={cache_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "--no-python", sys.executable, "-c", RANK_WRAPPER, *args]
    rss_dir = os.path.join(log_dir, "rss")
    os.makedirs(rss_dir, exist_ok=True)
    # the env var too: the cache folder whether or not the entry point passes data.cache_dir
    env = {**subprocess_env(threads=1), "BENCH_RSS_DIR": rss_dir,
           "MEGATRON_SFT_DATA_CACHE": cache_dir}
    t0 = time.perf_counter()
    run_launch(cmd, env, timeout_s, "SFT launch", cwd=str(REPO_ROOT))
    seconds = time.perf_counter() - t0
    rss = []
    for name in sorted(os.listdir(rss_dir)):
        with open(os.path.join(rss_dir, name), encoding="utf-8") as f:
            rss.append(json.load(f))
    if len(rss) != ranks:
        raise RuntimeError(f"{len(rss)} of {ranks} ranks reported their memory")
    return {"seconds": seconds, "rss": rss}


def run_data(quick: bool) -> BenchResult:
    from transformers import AutoTokenizer

    rows = QUICK_ROWS if quick else FULL_ROWS
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        data = os.path.join(tmp, "chat.jsonl")
        t0 = time.perf_counter()
        chars = generate_chat_file(data, rows)
        gen_s = time.perf_counter() - t0
        model = _char_model(os.path.join(tmp, "model"))
        tok = AutoTokenizer.from_pretrained(model)
        rates = []
        for workers in (0, 1, 2):
            rates.append(_build_rate(data, tok, workers, os.path.join(tmp, f"cache{workers}")))
        cache = os.path.join(tmp, "cache_sft")
        uncached = _sft_launch(model, data, cache, 2, os.path.join(tmp, "log_u"))
        cached = _sft_launch(model, data, cache, 2, os.path.join(tmp, "log_c"))
        small_rows = max(rows // 20, 64)
        small_run = four = None
        if not quick:  # 4 ranks; does the memory of a rank grow with the dataset? (20x fewer)
            four = _sft_launch(model, data, cache, 4, os.path.join(tmp, "log_4"))
            small = os.path.join(tmp, "small.jsonl")
            generate_chat_file(small, small_rows, seed=1)
            small_run = _sft_launch(model, small, cache, 2, os.path.join(tmp, "log_s"))
    best = max(rates, key=lambda r: r["rows_per_s"])
    tokens = rates[0]["tokens"]
    rate_rows = [[str(r["workers"]), str(r["rows"]), fmt(r["seconds"], 1),
                  fmt(r["rows_per_s"], 0), fmt(r["tokens_per_s"] / 1e6, 2)] for r in rates]
    t_rates = Table(f"Rendering {rows} chat rows ({tokens / 1e6:.1f}M tokens) into an empty "
                    "cache", ["workers", "rows", "seconds", "rows/s", "M tokens/s"], rate_rows,
                    ["workers 0: in the loading process."])
    t_step = Table("Time to the first optimizer step (python -m engine.sft, 2 gloo ranks, "
                   "tiny Qwen3, whole launch)", ["cache", "seconds"],
                   [["empty (render + build)", fmt(uncached["seconds"], 1)],
                    ["built (map only)", fmt(cached["seconds"], 1)]])

    def rss_rows(label, run):
        return [[label, str(r["rank"]), fmt(r["rss_mb"], 0), fmt(r["hwm_mb"], 0),
                 fmt(r["anon_mb"], 0), fmt(r["file_mb"], 0)] for r in run["rss"]]

    t_rss = Table("Memory per rank at the end of the first step (MB, cached)",
                  ["run", "rank", "VmRSS", "VmHWM", "RssAnon", "RssFile"],
                  rss_rows(f"2 ranks, {rows} rows", cached)
                  + (rss_rows(f"4 ranks, {rows} rows", four) if four else [])
                  + (rss_rows(f"2 ranks, {small_rows} rows", small_run) if small_run else []),
                  ["RssFile holds the shared, read-only pages of the mapped cache (and "
                   "libraries): one copy per node in the page cache."])
    summary = {
        "data_rows": rows, "data_tokens": tokens, "data_chars": chars,
        "data_generate_s": gen_s,
        "data_rows_per_s": best["rows_per_s"], "data_tokens_per_s": best["tokens_per_s"],
        "data_rows_per_s_by_workers": {str(r["workers"]): r["rows_per_s"] for r in rates},
        "first_step_s_uncached": uncached["seconds"], "first_step_s_cached": cached["seconds"],
        "rss_mb_per_rank": max(r["rss_mb"] for r in cached["rss"]),
        "rss_anon_mb_per_rank": max(r["anon_mb"] for r in cached["rss"]),
        "rss_mb_per_rank_4": max(r["rss_mb"] for r in four["rss"]) if four else None,
        "rss_anon_mb_per_rank_small": (max(r["anon_mb"] for r in small_run["rss"])
                                       if small_run else None),
        "data_quick": quick,
    }
    return BenchResult([t_rates, t_step, t_rss], summary)
