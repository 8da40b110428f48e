"""`megatron-sft-engine serve` / `python -m engine.serve`: any HF checkpoint the rollout engines
load (hf: transformers, vllm), served OpenAI-compatibly at one fixed base URL ending in /v1, for
evaluation and for LLM judges (reward.judge.*; docs/agents.md, "Serving a checkpoint").

Built on the OpenAI protocol of engine.api (request checks and their 400s, the chat template's
rules, replies, the generate queue, the HTTP plumbing), which the agent endpoint of RL episodes
also speaks, and on the generation engines (engine.generation, with SamplingBackend): a serve
endpoint is stateless, every request is rendered whole. A step-level backend (the vllm
engine: vLLM's step API, engine.generation.vllm.stepper) is served by engine.api.stepping's
continuous batching, which the agent endpoint shares: requests join the running step.

Modules (one job each):
    admission  what one request may ask before it is queued: its choices (--max-choices),
               the context budget (engine.api.budget), scoring memory (--max-score-gib)
    batching   the queue's rule for independent clients (gather, then one generate call),
               its bound (--max-queue: 429), failed calls retried in halves (503 only for
               the failing request) and its closing on SIGTERM (503)
    live       live streams of a step-level endpoint (each step's new text as chunks)
    endpoint   the FastAPI app (/v1/models, /v1/chat/completions, /v1/completions), seeds
    folder     the --model folder checked before anything heavy is imported
    model      the folder loaded on the hf or vllm rollout engine
    tokenizer_routes  /tokenize, /detokenize, /tokenizer_info (vLLM's, at the root) and
               GET /v1/models/{id}
    run        the serving lifetime: load, listen, serve, stop on SIGTERM / Ctrl-C
    __main__   the command line: flags and their checks, --help

May import: engine.api, engine.generation, engine.config (rollout_settings: the vllm engine's
default settings), engine.data, engine.errors; never engine.rl. Nothing imports engine.serve
(tests/test_structure.py).
"""
