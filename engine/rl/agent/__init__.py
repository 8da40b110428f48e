"""Agents through an OpenAI-compatible endpoint (docs/agents.md): a user's program drives an
episode by calling a per-episode `base_url`; the server keeps every call's token ids exactly
(token-in/token-out, the observation rule of docs/multi-turn.md) and runs the calls of
concurrent episodes together: continuous batching over the engine's step driver where the
rollout is one engine in this process (each call joins the running engine step), else one
generate call per gathered batch (engine.rl.agent.rollout says which).

Modules (one job each):
    sessions   per-episode bookkeeping: calls matched to earlier calls, trajectories
    server     the FastAPI app on uvicorn in a background thread, one URL per episode
    runner     the user's function(base_url, row) per episode, concurrently, with deadlines
    rollout    one generation batch of agent episodes for the RL collector, its dump records
    checks     the env.agent* keys, checked before any process group

The OpenAI protocol itself (request checks, template rules, replies, the generate queue, the
HTTP plumbing) is engine.api, shared with `serve`.

May import: engine.api, engine.rl.algo (the overlong penalty), engine.rl.env,
engine.generation, engine.data, engine.errors.
"""
