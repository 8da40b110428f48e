"""Agents through an OpenAI-compatible endpoint (docs/agents.md): a user's program drives an
episode by calling a per-episode `base_url`; the server keeps every call's token ids exactly
(token-in/token-out, the observation rule of docs/multi-turn.md) and batches the calls of
concurrent episodes into one generate call of the backend.

Modules (one job each):
    protocol   the batched generate backend the server calls (requests, results, seeds),
               and SamplingBackend: that protocol over a rollout engine's generate
    requests   OpenAI request bodies checked against the run's limits (400s that say why)
    tokens     the chat template's rules: prompts, observations, the end-of-turn marker
    sessions   per-episode bookkeeping: calls matched to earlier calls, trajectories
    replies    generated ids as OpenAI responses (stop strings, tool calls, log-probs)
    batcher    the queue between the HTTP thread and the thread that owns the engines
    server     the FastAPI app on uvicorn in a background thread, one URL per episode
    runner     the user's function(base_url, row) per episode, concurrently, with deadlines
    rollout    one generation batch of agent episodes for the RL collector, its dump records
    checks     the env.agent* keys, checked before any process group

May import: engine.rl.algo (the overlong penalty), engine.rl.env, engine.rl.rollout, engine.data,
engine.errors.
"""
