"""The OpenAI-compatible protocol both servers speak: the agent endpoint of RL episodes
(engine.rl.agent) and `megatron-sft-engine serve` (engine.serve). Neither server's own rules
live here: episodes and their trajectories are engine.rl.agent's, the serving lifetime and its
model engine.serve's.

Modules (one job each):
    requests   OpenAI request bodies checked against the limits (Limits, Call; 400s that say why)
    tokens     the chat template's rules (TemplateRules): prompts, observations, the end-of-turn
               marker, reply text
    replies    generated ids as OpenAI responses (stop strings, tool calls, log-probs)
    backend    the batched generate protocol the servers call (GenerateRequest, GenerateResult,
               GenerateBackend) and the seeds of calls (turn_seed, call_seed)
    budget     the context-budget rule of both servers (a reply's max_tokens, or 400 "context
               length exceeded")
    batcher    the queue between the HTTP thread and the thread that owns the engines (its
               bound: 429; a failed generate call: 503; closed while stopping: 503)
    stepping   continuous batching over a step-level backend (the owner thread's loop: requests
               join the running engine step; both servers, when their engine has a driver)
    failures   the answer to a request that failed inside a server (a short message naming the
               request id; the exception to the server's error log, never to the client)
    http       uvicorn in a daemon thread, the JSON body (its size limit, its shape), error
               bodies, the key, the request log line

May import: engine.data (chat rendering, row checks, the template delta, tool-call formats),
engine.errors. Never imports engine.rl, engine.serve or any training package: a rollout engine
serves the protocol through engine.generation.sampling_backend.
"""
