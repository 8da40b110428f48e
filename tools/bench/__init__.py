"""The engine's benchmarks (docs/benchmarks.md): `python -m tools.bench NAME [--quick]` (or
`megatron-sft-engine bench NAME`) runs __main__.py, the dispatcher, with one module per benchmark:

    overhead.py   engine SFT step vs bare megatron-core (torchrun, TP2 x DP2)
    balance.py    DP balance and packing's padding fraction
    rollout.py    HF rollout: one generate call per rollout batch vs one per micro-batch
    engines.py    rollout engine scaling (`rollout --engines 1,2`)
    backends.py   rollout tokens/s, rollout.backend=hf vs vllm
    sync.py       Megatron -> rollout engine weight sync GB/s
    async_rl.py   async RL step time, rollout.max_staleness 1 vs 0 (`async`)
    mfu.py        ~1B SFT step TFLOP/s and MFU (CUDA)
    data.py       data pipeline: rendering rate, first step, RSS per rank
    loss_head.py  peak memory, unchunked vs chunked loss head
    common.py     tables, the result protocol, machine facts, child launches

and two standalone scripts, `python -m tools.bench.experts` (grouped vs sequential experts) and
`python -m tools.bench.gpu_sft` (single-GPU SFT through the real entry point). The workers that
torchrun starts run `python -m tools.bench _NAME_worker`, with the repo root on PYTHONPATH.
"""
