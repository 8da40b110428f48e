"""What the checklist reports: each item's metrics and the summary table (the environment line:
tools.bench.gpu.environment).

`read_metrics(item)` reads an item's result file: gpu_sft's --json (per case: step s,
tokens/s, TFLOP/s, MFU, peak GiB, losses, mtp/loss and mtp/accuracy first and last where the
case trains MTP, the profiled step's summary (tools/bench/gpu/step_profile.py) where the item
profiles one; the run's tokens per sequence and vocabulary), tools.bench.peer's --json (per
mode: the same numbers plus the first step's seconds, compile included), tools.bench mfu's
summary (kind bench: MFU, TFLOP/s, step s of the ~1.1B step), tools.bench spec's summary
(kind spec: tokens/s both ways, speedup, acceptance, greedy ids equal), varlen_check's
results (kind varlen: per case the path, max differences, errors, ms each way), tools.bench
trl's summary (kind trl: per workload each row's speedup over TRL, gpu/trl_item), tools.bench
tinker's summaries (kind tinker: per backend the concurrent / sequential ratio and batch rows,
gpu/tinker_item) or the engine's metrics.jsonl (per step: the keys of items.RL_KEYS for GRPO;
loss, grad_norm and step time for SFT). It raises (OSError, ValueError) when there is nothing
to read, and lists under "problems" what makes the item fail: fewer steps than asked, a
missing key, a non-finite number. `key_numbers(record)` is the
one-line digest of a record for `table(records)` (item | status | s | est. s | key numbers;
a skipped item's status says why). `engine_peer_ratios(records)`: the engine's tokens/s over
the peer's, for every sft case against every peer mode, when both items are there (ratios of
one call, one card), for the sft cases of the peer's model (gpu_sft.CASES: the dense model;
the MoE is another model); the table's last line and results.json's "ratios".
"""
from __future__ import annotations

import json

from tools.bench.gpu.items import RL_KEYS, Item
from tools.bench.gpu.numbers import finite, fmt
from tools.bench.gpu.packed_report import packed_digest, read_packed
from tools.bench.gpu.tinker_item import read_tinker, tinker_digest
from tools.bench.gpu.trl_item import read_trl, trl_digest
from tools.bench.gpu_sft import CASES, DENSE, TINY_DENSE

SFT_CASE_KEYS = ("rc", "step_s", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "finite",
                 "mtp_loss", "mtp_accuracy", "profile")
PEER_KEYS = ("step_s", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "finite", "compile_s",
             "profile")
MFU_KEYS = ("mfu", "tflops_per_gpu", "mfu_step_s", "mfu_params", "mfu_tokens_per_step_per_gpu",
            "mfu_gpu")
SPEC_KEYS = ("plain_tokens_per_s", "spec_tokens_per_s", "spec_speedup", "spec_acceptance",
             "spec_mean_accepted_tokens", "spec_greedy_ids_equal")
SFT_RUN_KEYS = ("loss", "grad_norm", "time/step_s")


def read_gpu_sft(item: Item) -> dict:
    """{gpu, peak_bf16_tflops, seq, vocab, cases: {case: {...}}} from gpu_sft's --json."""
    data = json.loads(item.result.read_text())
    args = data.get("args") or {}
    vocab = args.get("vocab") or (TINY_DENSE if args.get("tiny") else DENSE)["vocab_size"]
    cases, problems = {}, []
    for res in data["results"]:
        case = {k: res.get(k) for k in SFT_CASE_KEYS}
        case["losses"] = res.get("losses")
        cases[res["case"]] = case
        if res.get("rc") != 0 or "step_s" not in res:
            problems.append(f"case {res['case']} failed (exit status {res.get('rc')})")
        elif not res.get("finite"):
            problems.append(f"case {res['case']}: non-finite loss or grad norm")
    return {"gpu": data.get("gpu"), "peak_bf16_tflops": data.get("peak_bf16_tflops"),
            "seq": args.get("seq"), "vocab": vocab, "cases": cases, "problems": problems}


def read_steps(item: Item) -> dict:
    """{steps: [{step, key: value}], problems} from an engine's metrics.jsonl."""
    with open(item.result) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"no steps in {item.result}")
    keys = RL_KEYS if item.kind == "rl" else SFT_RUN_KEYS
    steps = [{"step": r.get("step"), **{k: r.get(k) for k in keys}} for r in rows]
    problems = []
    if len(rows) < item.expected_steps:
        problems.append(f"{len(rows)} of {item.expected_steps} steps")
    missing = sorted({k for s in steps for k in keys if s[k] is None})
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    bad = sorted({k for s in steps for k in keys if s[k] is not None and not finite(s[k])})
    if bad:
        problems.append(f"non-finite: {', '.join(bad)}")
    return {"steps": steps, "finite": not bad, "problems": problems}


def read_spec(item: Item) -> dict:
    """tools.bench spec's summary keys (SPEC_KEYS); greedy ids that differ with speculation
    are a problem (they must be equal)."""
    data = json.loads(item.result.read_text())
    metrics = {k: data.get(k) for k in SPEC_KEYS}
    missing = [k for k in SPEC_KEYS if metrics[k] is None]
    problems = [f"missing: {', '.join(missing)}"] if missing else []
    if metrics["spec_greedy_ids_equal"] is False:
        problems.append("greedy ids differ with speculation")
    return {**metrics, "problems": problems}


def read_peer(item: Item) -> dict:
    """{gpu, peak_bf16_tflops, seq, torch, transformers, modes: {mode: {...}}} from
    tools.bench.peer's --json; a mode that is not finite, or missing, is a problem."""
    data = json.loads(item.result.read_text())
    args = data.get("args") or {}
    modes, problems = {}, []
    for res in data["results"]:
        modes[res["mode"]] = {**{k: res.get(k) for k in PEER_KEYS}, "losses": res.get("losses")}
        if not res.get("finite"):
            problems.append(f"peer {res['mode']}: non-finite loss")
    asked = [m for m in (args.get("modes") or "").split(",") if m]
    problems += [f"peer {m}: no result" for m in asked if m not in modes]
    return {"gpu": data.get("gpu"), "peak_bf16_tflops": data.get("peak_bf16_tflops"),
            "seq": args.get("seq"), "sequences": args.get("gbs"), "dtype": args.get("dtype"),
            "torch": data.get("torch"), "transformers": data.get("transformers"),
            "modes": modes, "problems": problems}


def read_bench(item: Item) -> dict:
    """tools.bench mfu's summary keys (MFU_KEYS); a missing mfu is a problem."""
    data = json.loads(item.result.read_text())
    metrics = {k: data.get(k) for k in MFU_KEYS}
    return {**metrics, "problems": [] if finite(metrics["mfu"]) else ["mfu: not measured"]}


def read_varlen(item: Item) -> dict:
    """{varlen_device, dtype, smoke, varlen_cases: {case: {...}}} from varlen_check's --json;
    a case whose `ok` is false (not the kernel on a card, or outside the bf16 tolerance) is
    a problem."""
    data = json.loads(item.result.read_text())
    cases = {r["case"]: r for r in data["results"]}
    problems = [f"varlen {n}: path {c.get('path')}, errors {c.get('err_candidate')} against "
                f"the loop's {c.get('err_loop')}" for n, c in cases.items() if not c.get("ok")]
    return {"varlen_device": data.get("device"), "dtype": data.get("dtype"),
            "smoke": data.get("smoke"), "varlen_cases": cases, "problems": problems}


def read_prefix(item: Item) -> dict:
    """{prefix_sharing: {workload: speedup, ratio, seconds, differences}} from tools.bench
    prefix_sharing's summary; a workload whose loss or grad norm differs by more than 1e-4
    (relative) between the modes is a problem, and on CUDA a shared workload whose tree
    attention was not FlexAttention alone (`attention`, parallel.tree_attention.PATHS_RUN)."""
    data = json.loads(item.result.read_text())
    work = {k[len("prefix_sharing_"):]: v for k, v in data.items()
            if k.startswith("prefix_sharing_") and isinstance(v, dict)}
    problems = [f"prefix_sharing {n}: loss {w['loss_rel']:.1e}, grad norm "
                f"{w['grad_norm_rel']:.1e} apart" for n, w in work.items()
                if max(w["loss_rel"], w["grad_norm_rel"]) > 1e-4]
    if data.get("prefix_sharing_device") == "cuda":   # shared rows must run FlexAttention
        problems += [f"prefix_sharing {n}: tree attention ran {w.get('attention')}, not flex"
                     for n, w in work.items() if w["ratio"] < 1 and
                     set(w.get("attention", {})) != {"flex"}]
    return {"prefix_sharing": work, "prefix_sharing_device": data.get("prefix_sharing_device"),
            "problems": problems}


def read_metrics(item: Item) -> dict:
    """The metrics of `item` (module docstring): its kind's reader; the engine's
    metrics.jsonl (read_steps) for the kinds rl and sft_run."""
    readers = {"prefix": read_prefix, "trl": read_trl, "tinker": read_tinker,
               "packed": read_packed, "varlen": read_varlen, "spec": read_spec,
               "peer": read_peer, "bench": read_bench, "sft": read_gpu_sft,
               "loss_head": read_gpu_sft}
    return readers.get(item.kind, read_steps)(item)


def profile_digest(profile: dict | None) -> str:
    """', GPU busy 71.2 % of a profiled step, 16,675 kernels, 3 host syncs' (or '')."""
    if not profile:
        return ""
    busy = profile.get("gpu_busy")
    syncs = profile.get("host_syncs")
    return (f", GPU busy {'n/a' if busy is None else f'{busy:.1%}'} of a profiled step, "
            f"{profile.get('kernels', 0):,} kernels, "
            f"{'n/a' if syncs is None else f'{syncs:,}'} host syncs")


def sft_digest(metrics: dict) -> str:
    parts = []
    for name, c in metrics.get("cases", {}).items():
        if c.get("step_s") is None:
            parts.append(f"{name} failed")
            continue
        losses = c.get("losses") or [None]
        mfu = "n/a" if c.get("mfu") is None else f"{c['mfu']:.1%}"
        parts.append(f"{name} {fmt(c['step_s'], '.3f')} s, {fmt(c['tokens_per_s'], ',.0f')} "
                     f"tok/s, MFU {mfu}, {fmt(c['peak_mem_gib'], '.1f')} GiB, loss "
                     f"{fmt(losses[0], '.3f')} -> {fmt(losses[-1], '.3f')}")
        if c.get("mtp_loss"):
            acc = c.get("mtp_accuracy") or [None, None]
            parts[-1] += (f", mtp/loss {fmt(c['mtp_loss'][0], '.3f')} -> "
                          f"{fmt(c['mtp_loss'][-1], '.3f')}, mtp/accuracy "
                          f"{fmt(acc[0], '.3f')} -> {fmt(acc[-1], '.3f')}")
        parts[-1] += profile_digest(c.get("profile"))
    return "; ".join(parts)


def peer_digest(metrics: dict) -> str:
    """'eager 1.316 s, 24,901 tok/s, MFU 12.5 %, 19.3 GiB (first step 1.5 s); compiled ...'."""
    parts = []
    for mode, m in metrics.get("modes", {}).items():
        mfu = "n/a" if m.get("mfu") is None else f"{m['mfu']:.1%}"
        parts.append(f"{mode} {fmt(m.get('step_s'), '.3f')} s, "
                     f"{fmt(m.get('tokens_per_s'), ',.0f')} tok/s, MFU {mfu}, "
                     f"{fmt(m.get('peak_mem_gib'), '.1f')} GiB (first step "
                     f"{fmt(m.get('compile_s'), '.1f')} s)" + profile_digest(m.get("profile")))
    return "; ".join(parts)


def bench_digest(metrics: dict) -> str:
    """'1.10B, 32,768 tokens/step: 1.180 s, 205.3 TFLOP/s, MFU 20.8 %'."""
    params, tokens = metrics.get("mfu_params"), metrics.get("mfu_tokens_per_step_per_gpu")
    mfu = "n/a" if not finite(metrics.get("mfu")) else f"{metrics['mfu']:.1%}"
    return (f"{fmt(params and params / 1e9, '.2f')}B, {fmt(tokens, ',.0f')} tokens/step: "
            f"{fmt(metrics.get('mfu_step_s'), '.3f')} s, "
            f"{fmt(metrics.get('tflops_per_gpu'), '.1f')} TFLOP/s, MFU {mfu}")


def engine_peer_ratios(records: list[dict]) -> dict[str, float]:
    """{"<sft case>/<peer mode>": engine tokens/s / peer tokens/s} over the ok sft and peer
    records of one call (empty when either is missing), dense-model cases only; e.g.
    "dense/compiled": 1.25."""
    by = {r["item"]: r for r in records if r.get("status") == "ok"}
    if "sft" not in by or "peer" not in by:
        return {}
    out = {}
    for case, c in (by["sft"].get("metrics") or {}).get("cases", {}).items():
        if CASES.get(case, ("",))[0] != "dense":
            continue
        for mode, m in (by["peer"].get("metrics") or {}).get("modes", {}).items():
            if finite(c.get("tokens_per_s")) and finite(m.get("tokens_per_s")) \
                    and m["tokens_per_s"] > 0:
                out[f"{case}/{mode}"] = round(c["tokens_per_s"] / m["tokens_per_s"], 4)
    return out


def spec_digest(metrics: dict) -> str:
    """'plain N tok/s, speculative M tok/s (x S), acceptance A, accepted per step K, greedy
    ids equal True'."""
    return (f"plain {fmt(metrics.get('plain_tokens_per_s'), ',.0f')} tok/s, speculative "
            f"{fmt(metrics.get('spec_tokens_per_s'), ',.0f')} tok/s (x"
            f"{fmt(metrics.get('spec_speedup'), '.3f')}), acceptance "
            f"{fmt(metrics.get('spec_acceptance'), '.3f')}, accepted per drafting step "
            f"{fmt(metrics.get('spec_mean_accepted_tokens'), '.2f')}, greedy ids equal "
            f"{metrics.get('spec_greedy_ids_equal')}")


def rl_digest(metrics: dict) -> str:
    steps = metrics.get("steps") or []
    if not steps:
        return ""
    first, last = steps[0], steps[-1]
    diffs = ", ".join(fmt(s["rollout/logprob_diff"], ".2e") for s in steps)
    return (f"logprob_diff {diffs} (step-1 max {fmt(first['rollout/logprob_diff_max'], '.3g')});"
            f" sync_logit_max_diff {fmt(first['debug/sync_logit_max_diff'], '.3g')}; "
            f"last step {fmt(last['time/step_s'], '.2f')} s = rollout "
            f"{fmt(last['time/rollout_s'], '.2f')} + logprob {fmt(last['time/logprob_s'], '.2f')}"
            f" + train {fmt(last['time/train_s'], '.2f')} + sync "
            f"{fmt(last['time/weight_sync_s'], '.3f')}")


def sft_run_digest(metrics: dict) -> str:
    steps = metrics.get("steps") or []
    losses = ", ".join(fmt(s["loss"], ".4f") for s in steps)
    norms = ", ".join(fmt(s["grad_norm"], ".2f") for s in steps)
    return f"losses {losses}; grad norms {norms}; finite {metrics.get('finite')}"


def head_digest(metrics: dict) -> str:
    """'16,384 tokens, vocab 151,936: chunked 0.607 s / 41.6 GiB; unchunked ...; same loss X'."""
    label = {"dense": "chunked", "unchunked": "unchunked"}
    parts, finals = [], []
    for name, c in metrics.get("cases", {}).items():
        if c.get("step_s") is None:
            parts.append(f"{label.get(name, name)} failed")
            continue
        parts.append(f"{label.get(name, name)} {fmt(c['step_s'], '.3f')} s / "
                     f"{fmt(c['peak_mem_gib'], '.1f')} GiB")
        finals.append(fmt((c.get("losses") or [None])[-1], ".3f"))
    if finals:
        parts.append(f"same loss {finals[0]}" if len(set(finals)) == 1
                     else f"losses {', '.join(finals)}")
    seq, vocab = metrics.get("seq"), metrics.get("vocab")
    head = f"{seq:,} tokens, vocab {vocab:,}: " if seq and vocab else ""
    return head + "; ".join(parts)


def varlen_digest(metrics: dict) -> str:
    """'causal_gqa (50 segments): varlen 1.20 ms vs loop 9.60 ms (x8.00), max |diff| out
    7.8e-03, dq ..., dk ..., dv ...; ...'."""
    parts = []
    for name, c in metrics.get("varlen_cases", {}).items():
        diff = c.get("max_abs_diff") or {}
        side = "varlen" if c.get("path") == "varlen" else c.get("path")
        parts.append(f"{name} ({c.get('segments')} segments): {side} "
                     f"{fmt(c.get('candidate_ms'), '.2f')} ms vs loop "
                     f"{fmt(c.get('loop_ms'), '.2f')} ms (x{fmt(c.get('speedup'), '.2f')}), "
                     "max |diff| " + ", ".join(f"{k} {fmt(v, '.1e')}" for k, v in diff.items()))
    return "; ".join(parts)


def key_numbers(record: dict) -> str:
    """One line of the numbers a session pastes into docs/benchmarks.md."""
    metrics = record.get("metrics") or {}
    if "packed_engine" in metrics:
        return packed_digest(metrics)
    if "varlen_cases" in metrics:
        return varlen_digest(metrics)
    if "trl" in metrics:   # 'grpo_shared x2.61 (engine_prefix_on x3.10, ...); sft x1.35'
        return trl_digest(metrics)
    if "tinker" in metrics:   # 'hf 0.412 (quartiles 0.40-0.45, rows 16 vs 4, met); megatron ...'
        return tinker_digest(metrics)
    if "prefix_sharing" in metrics:   # 'grpo x3.10 (ratio 0.27; flex); dpo ...'
        return "; ".join(f"{n} x{w['speedup']:.2f} (ratio {w['ratio']:.2f}; "
                         f"{'/'.join(sorted(w.get('attention') or {})) or 'unshared'})"
                         for n, w in metrics["prefix_sharing"].items())
    if "spec_speedup" in metrics:
        return spec_digest(metrics)
    if "modes" in metrics:
        return peer_digest(metrics)
    if "mfu_step_s" in metrics:
        return bench_digest(metrics)
    if "cases" in metrics:
        return head_digest(metrics) if record.get("kind") == "loss_head" else \
            sft_digest(metrics)
    if metrics.get("steps") and "rollout/logprob_diff" in metrics["steps"][0]:
        return rl_digest(metrics)
    if metrics.get("steps"):
        return sft_run_digest(metrics)
    return ""


def table(records: list[dict]) -> str:
    """A Markdown table: item | status | s | est. s | key numbers (module docstring)."""
    lines = ["| item | status | s | est. s | key numbers |", "|---|---|---|---|---|"]
    for r in records:
        status = f"skipped: {r.get('reason')}" if r["status"] == "skipped" else r["status"]
        note = key_numbers(r)
        if r.get("error") and r["error"] not in note:
            note = f"{note} ({r['error']})" if note else r["error"]
        if r.get("note"):
            note = f"{note} ({r['note']})" if note else r["note"]
        seconds = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        estimate = f"~{r['estimate_s']:.0f}" if r.get("estimate_s") else ""
        lines.append(f"| {r['item']} | {status} | {seconds} | {estimate} | {note} |")
    ratios = engine_peer_ratios(records)
    if ratios:
        lines.append("\nEngine/peer tokens/s (sft case / peer mode, this call): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in ratios.items()))
    return "\n".join(lines)
