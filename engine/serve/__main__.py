"""`python -m engine.serve --model DIR` (the console's `megatron-sft-engine serve`): serve a
Hugging Face checkpoint OpenAI-compatibly at http://HOST:PORT/v1 until SIGTERM or Ctrl-C
(docs/agents.md, "Serving a checkpoint"). Exit 0 after a signal (the requests in flight are
answered, queued ones get 503), 2 for a bad flag or --model folder (one line naming it), 1
when the engine dies.
"""
from __future__ import annotations

import argparse
import os
import sys

from engine.api.sampling_fields import FIELDS
from engine.serve.admission import DEFAULT_MAX_CHOICES, DEFAULT_MAX_N, DEFAULT_MAX_SCORE_GIB
from engine.serve.batching import DEFAULT_MAX_QUEUE
from engine.serve.folder import BACKENDS, DTYPES, folder_problem, model_context

# the API key's environment variable (--api-key wins); VLLM_API_KEY is deliberately not read:
# a shell that talks to a vLLM server of its own keeps that key for it, and must not lock this one
API_KEY_ENV = "MEGATRON_SFT_ENGINE_API_KEY"

DESCRIPTION = """Serve a Hugging Face checkpoint OpenAI-compatibly (/v1/models,
/v1/chat/completions, /v1/completions; vLLM's /tokenize, /detokenize and /tokenizer_info at the
root) for evaluation and for LLM judges (reward.judge.*).
On vllm (vLLM in this process) and on hf (transformers, slots of a static KV cache) requests
join the running batch at the next engine step and `stream: true` sends text as it is
sampled (an hf model with a vision tower or non-full-attention layers batches concurrent
requests into one generate call instead, its stream sent after it). A request's temperature,
top_p, max_tokens (capped at --max-tokens), n (at most --max-n), stop, logprobs and tools are
honoured, and so are vLLM's sampling fields ({fields}) with vLLM's ranges and meanings, on both
backends; a request without `seed` samples with a seed derived from --seed and its arrival
number, one with `seed` samples the same reply whatever else is served. Every request is
logged in one line (route, status, tokens, milliseconds; --quiet: none). SIGTERM or Ctrl-C
stops it (exit 0): queued requests get 503."""

EXAMPLES = """examples:
  {prog} --model runs/x/hf --port 8000
  {prog} --model /models/Qwen3-8B --backend vllm --max-tokens 1024 --temperature 0
  MEGATRON_SFT_ENGINE_API_KEY="$(openssl rand -hex 16)" {prog} --model runs/x/hf --host 0.0.0.0
  then: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  (or the --api-key)"""


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description=DESCRIPTION.format(fields=", ".join(FIELDS)),
                                epilog=EXAMPLES.format(prog=prog),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local HF checkpoint folder (config.json, weights, tokenizer)")
    p.add_argument("--backend", choices=BACKENDS, default="hf",
                   help="rollout engine: hf (transformers, CPU or GPU) or vllm (default: hf)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name /v1/models lists (default: the folder's name); requests "
                        "may name any model")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="default sampling temperature, 0 = greedy (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top_p (default: 1.0)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="tokens of a reply: the default and the cap of a request's "
                        "max_tokens (default: 256)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + reply tokens (default: the model's max_position_embeddings)")
    p.add_argument("--seed", type=int, default=0,
                   help="the seeds of requests without one derive from it (default: 0)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights' dtype (default: auto, the checkpoint's)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="hf batch path: a batch goes this long after its oldest request "
                        "arrived (default: 20; unused where requests join the running step)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="hf batch path: requests per generate call at most (default: no "
                        "limit; unused where requests join the running step)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="requests must send 'Authorization: Bearer KEY' (OpenAI(api_key=KEY)); "
                        f"others get 401 (default: ${API_KEY_ENV} when set, which keeps the "
                        "key out of `ps`; else none, open; /health is always open)")
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                   help="a request body over this many MiB gets 413 (default: 16)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="a request arriving while N choices wait for the engine (vllm: "
                        "queued or running in it) gets 429 "
                        f"(code queue_full, Retry-After; default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-choices", type=int, default=None, metavar="N",
                   help="a request of more than N choices (prompts x n) gets 400 before it "
                        "is tokenized (code too_many_choices; at most --max-queue; default: "
                        f"{DEFAULT_MAX_CHOICES}, or --max-queue when smaller)")
    p.add_argument("--max-n", type=int, default=None, metavar="N",
                   help="a request whose n (choices per prompt) exceeds N gets 400 naming the "
                        f"flag (default: {DEFAULT_MAX_N}, or --max-choices when smaller; "
                        "pass@16 needs 16; at most --max-choices)")
    p.add_argument("--max-score-gib", type=float, default=None, metavar="G",
                   help="a request with log-probs whose prompt plus max_tokens needs more than "
                        "G GiB of float32 log-probs (tokens x vocabulary x 4 bytes) gets 400 "
                        "(code scoring_too_large; inf: no limit; default: "
                        f"{DEFAULT_MAX_SCORE_GIB:g} on hf, inf on vllm, which scores in chunks)")
    p.add_argument("--quiet", action="store_true",
                   help="no log line per request (default: one INFO line each: route, "
                        "status, prompt and completion tokens, milliseconds)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vllm: run the model eagerly, as vLLM's --enforce-eager (default: "
                        "compiled as vLLM's server does; a start about 35 s longer on a 2-core "
                        "CPU host, decode steps about 3x faster there; hf: unused)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="the folder's own tokenizer code may run")
    return p


def flag_problems(args) -> list[str]:
    """One sentence per bad flag, naming it."""
    checks = [(0 <= args.temperature <= 2, f"--temperature {args.temperature} must be in [0, 2]"),
              (0 < args.top_p <= 1, f"--top-p {args.top_p} must be in (0, 1]"),
              (args.max_tokens >= 1, f"--max-tokens {args.max_tokens} must be >= 1"),
              (0 <= args.port <= 65535, f"--port {args.port} must be in [0, 65535]"),
              (args.batch_wait_ms >= 0, f"--batch-wait-ms {args.batch_wait_ms} must be >= 0"),
              (args.max_batch is None or args.max_batch >= 1,
               f"--max-batch {args.max_batch} must be >= 1"),
              (args.api_key is None or (args.api_key.isprintable() and args.api_key.strip()
                                        and not any(c.isspace() for c in args.api_key)),
               f"{args.api_key_from} must be a non-empty key without spaces"),
              (1 <= args.max_body_mb * 2 ** 20 < float("inf"), f"--max-body-mb "
               f"{args.max_body_mb} must be a finite size of at least one byte"),
              (args.max_queue >= 1, f"--max-queue {args.max_queue} must be >= 1"),
              (args.max_choices is None or 1 <= args.max_choices <= args.max_queue,
               f"--max-choices {args.max_choices} must be in [1, --max-queue "
               f"{args.max_queue}]"),
              (args.max_n >= 1 and (args.max_choices is None or args.max_n <= args.max_choices),
               f"--max-n {args.max_n} must be in [1, --max-choices {args.max_choices}]"),
              (args.max_score_gib is None or args.max_score_gib > 0,
               f"--max-score-gib {args.max_score_gib} must be > 0 (inf: no limit)"),
              (args.max_context is None or args.max_context > args.max_tokens,
               f"--max-context {args.max_context} must exceed --max-tokens {args.max_tokens} "
               "(room for the prompt)")]
    return [message for ok, message in checks if not ok]


def fill_defaults(args, environ=os.environ) -> None:
    """The defaults that depend on more than the flag: the API key (--api-key, else
    $MEGATRON_SFT_ENGINE_API_KEY when set; an empty one is refused by flag_problems, never read
    as "open"; args.api_key_from names where it came from), --max-score-gib (by backend) and
    --max-choices (at most --max-queue) and --max-n (at most --max-choices)."""
    args.api_key_from = "--api-key"
    if args.api_key is None and API_KEY_ENV in environ:
        args.api_key, args.api_key_from = environ[API_KEY_ENV], API_KEY_ENV
    if args.max_score_gib is None:
        args.max_score_gib = DEFAULT_MAX_SCORE_GIB if args.backend == "hf" else float("inf")
    if args.max_choices is None and args.max_queue >= 1:
        args.max_choices = min(DEFAULT_MAX_CHOICES, args.max_queue)
    if args.max_n is None:   # the default never exceeds the choices a request may hold
        args.max_n = min(DEFAULT_MAX_N, args.max_choices or DEFAULT_MAX_N)


def settled(args) -> str | None:
    """Check the folder and fill --max-context; why it cannot be served, or None."""
    problem = folder_problem(args.model)
    if problem:
        return problem
    if args.max_context is None:
        args.max_context = model_context(args.model)
        if args.max_context is None:
            return (f"--model {args.model!r}: config.json has no max_position_embeddings; "
                    "give --max-context")
        if args.max_context <= args.max_tokens:
            return (f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                    f"model's context of {args.max_context} tokens; lower it")
    return None


def main(argv: list[str] | None = None, prog: str = "python -m engine.serve") -> int:
    args = parser(prog).parse_args(argv)
    fill_defaults(args)
    problems = flag_problems(args)
    problem = None if problems else settled(args)
    for line in problems + ([problem] if problem else []):
        print(f"error: {line}", file=sys.stderr)
    if problems or problem:
        return 2
    # torch, transformers, fastapi (seconds): only once the flags and the folder are good
    from engine.serve.run import serve_model

    return serve_model(args)


if __name__ == "__main__":
    sys.exit(main())
