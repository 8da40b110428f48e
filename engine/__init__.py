"""Training engines (SFT, RL) built on the models bridge and the parallel layer.

One package per concern; package-level imports run one way (tests/test_structure.py checks it):

    config      <- schema, loading, model/MoE settings, recipe validation (may import data,
                   training, checkpoint for the checks it shares with them)
    data        data files, row checks, chat-template rendering, the per-node cache
    training    TrainEngine and everything one optimizer step needs
    checkpoint  save/resume at any layout
    run         RunLoop around every step; may import config, training, checkpoint
    sft, rl,    entry points (`python -m engine.sft`, `python -m engine.rl`, `python -m engine.dpo`,
    dpo, rm,    `python -m engine.rm`, `python -m engine.kto`); nothing imports them, and they
    kto         never import each other
    preference  the core dpo, kto and rm share (the reference, per-sequence context-parallel
                sums, the float64 loss scaffold, the run loop, chunked evaluation); only they
                import it
    api         the OpenAI-compatible protocol both servers speak (request checks, template
                rules, replies, the generate queue, HTTP plumbing); imports data only, and only
                rl (the agent endpoint) and serve import it
    generation  the generation engines (hf, vllm, sglang; weight-sync transport, the engine pool):
                RL's rollout, serve, the agent endpoint and judges run on them; imports api's
                protocol, config's LoRA spec and models, never rl, serve or training
    serve       `python -m engine.serve`: a checkpoint served OpenAI-compatibly (api) on the
                generation engines; nothing imports it, it trains nothing, it never imports rl

data and training never import run, sft, rl, dpo, rm, kto, preference or checkpoint; run
never imports sft, rl, dpo, rm, kto or preference.
`cli.py` and `errors.py` are shared by the entry points.
"""
