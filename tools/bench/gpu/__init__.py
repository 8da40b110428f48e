"""`python -m tools.bench gpu`: the GPU checklist in one call (docs/benchmarks.md, Reproducing).

    python -m tools.bench gpu --out /tmp/gpu                   # every item: 352 s on one H100
    python -m tools.bench gpu --items grpo,vision --out DIR    # some items, in the order given
    python -m tools.bench gpu --dry-run                         # the exact commands, nothing run
    python -m tools.bench gpu --cpu-smoke --out DIR             # grpo and vision, tiny, fp32, CPU

Items (each one or more subprocesses under one timeout; a failure or timeout is recorded and
the next item still runs; items that would start after `--budget-s` are recorded as skipped):
  sft        tools/bench/gpu_sft.py cases dense,moe (0.6B dense, 16-expert MoE), 4,096 tokens,
             8 sequences per step, 8 steps: step s, tokens/s, MFU, peak GiB, losses
  loss_head  gpu_sft dense (chunked loss head) vs unchunked at 16,384 tokens, vocabulary 151,936
  grpo       engine.rl GRPO, HF rollout backend, bf16, rollout.check_weight_sync=true, the demo
             model at hidden 512 / 8 layers / FFN 1536 and the addition prompts, 3 steps:
             rollout/logprob_diff(_max), debug/sync_logit_max_diff and the step-time split
  lora_grpo  grpo with model.lora.init_from a small non-zero peft adapter (B scaled by 0.05)
  vision     the counting demo's Qwen3-VL, trained vision tower, text-only micro-batches,
             parallel.overlap_grad_reduce at its default: losses and grad norms, finite

Output: OUT/results.json (one record per item: status ok|failed|timeout|skipped, seconds,
metrics, commands; rewritten after every item, so a killed call keeps what finished),
OUT/<item>.log (the tail of the item's output), and on stdout a Markdown table of the key
numbers, the environment line (GPU, driver, versions, CPU) and, last, one JSON line.
Without CUDA (and without --cpu-smoke) it prints `skipped: no CUDA` and exits 0.

Modules: items (the commands), runner (subprocesses, timeouts, budget), report (metrics
read from each item's files, the table, the environment), prep (the LoRA adapter and the
mixed image/text rows), cli (the flags).
"""
