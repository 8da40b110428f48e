"""The `packed` item's part of the GPU report (tools.bench.gpu.report): its metrics read from
tools/bench/gpu_packed.py's --json and its one-line digest."""
from __future__ import annotations

import json

from tools.bench.gpu.items import Item
from tools.bench.gpu.numbers import fmt


def read_packed(item: Item) -> dict:
    """{packed_engine: tokens/s, MFU, step s, peak GiB, compile counts (last step), token
    check; packed_peer: {mode: tokens/s, MFU, peak GiB or error}; ratios; length_stats} from
    gpu_packed's --json; a token mismatch, a non-finite loss or a failed peer is a problem."""
    data = json.loads(item.result.read_text())
    e = data["engine"]
    engine = {k: e.get(k) for k in ("tokens_per_s", "mfu", "step_s", "peak_mem_gib",
                                    "tokens_match", "graphs_grew_after_warmup")}
    engine["compile"] = {k.split("/")[1]: v[-1] for k, v in (e.get("compile") or {}).items()
                         if v}
    peers = {m: {k: p.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_gib", "error")}
             for m, p in (data.get("peer") or {}).items()}
    problems = ([] if e.get("tokens_match") else ["packed: packed tokens != drawn lengths"])
    problems += [] if e.get("finite") else ["packed: non-finite loss"]
    problems += [f"packed peer {m}: {p['error']}" for m, p in peers.items() if p.get("error")]
    return {"packed_engine": engine, "packed_peer": peers, "length_stats":
            data.get("length_stats"), "gpu": data.get("gpu"), "problems": problems,
            **{k: v for k, v in data.items() if k.startswith("engine_over_peer")}}


def packed_digest(metrics: dict) -> str:
    """'engine 30,000 tok/s, MFU 15.0%, peak 40.1 GiB, graphs 60 recompiles 4 breaks 0
    (grew after warm-up: False); peer eager 20,000 tok/s (x1.50), compiled ...'."""
    e, stats = metrics["packed_engine"], metrics.get("length_stats") or {}
    c = e.get("compile") or {}
    mfu = "n/a" if e.get("mfu") is None else f"{e['mfu']:.1%}"
    parts = [f"lengths mean {fmt(stats.get('mean'), '.0f')} (max {stats.get('max')}): engine "
             f"{fmt(e.get('tokens_per_s'), ',.0f')} tok/s, MFU {mfu}, peak "
             f"{fmt(e.get('peak_mem_gib'), '.1f')} GiB, graphs {c.get('graphs')} recompiles "
             f"{c.get('recompiles')} breaks {c.get('graph_breaks')} (grew after warm-up: "
             f"{e.get('graphs_grew_after_warmup')})"]
    for mode, p in metrics.get("packed_peer", {}).items():
        ratio = metrics.get(f"engine_over_peer_{mode}")
        parts.append(f"peer {mode} " + (p["error"] if p.get("error") else
                                        f"{fmt(p.get('tokens_per_s'), ',.0f')} tok/s "
                                        f"(engine x{fmt(ratio, '.2f')})"))
    return "; ".join(parts)
