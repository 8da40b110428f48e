"""`python -m tools.bench gpu`: the GPU checklist in one call, within a time budget.

docs/benchmarks.md ("On a GPU: the checklist in one call") says how to run it and what it printed.

    python -m tools.bench gpu --out /tmp/gpu                   # the plan within 480 s (one H100)
    python -m tools.bench gpu --budget-s 600 --out /tmp/gpu    # a longer budget: more items fit
    python -m tools.bench gpu --items grpo,vision --out DIR    # some items, in the order given
    python -m tools.bench gpu --dry-run                        # the plan, the commands and the
                                                               # report's skeleton; nothing run
                                                               # or written
    python -m tools.bench gpu --cpu-smoke --out DIR            # manual: grpo and vision, tiny,
                                                               # fp32, on the CPU (~50 s)

Items, in the default order (the most information per minute first; ~ = estimated seconds on
one H100, what the budget counts):
  sft            ~125  gpu_sft cases dense,moe (0.6B dense, 16-expert MoE; fusions off, grouped
                       experts on), 4,096 tokens, 8 sequences per step, 8 steps: step s,
                       tokens/s, MFU, peak GiB, losses; step 3 profiled (step_profile.py):
                       GPU busy share, kernels and host syncs per step
  peer           ~150  tools/bench/peer.py: sft's dense shape and tokens in plain transformers
                       (Qwen3ForCausalLM, SDPA, fused AdamW, fp32 params + bf16 autocast, 8 x 1
                       micro-batches), eager and torch.compile'd: step s, tokens/s, MFU (the
                       engine's FLOP count), peak GiB, a profiled step; the table's last line
                       and results.json "ratios": engine/peer tokens/s per sft case and mode
  mtp            ~135  gpu_sft cases mtp_off,mtp_on: a GLM-4.5-shaped MoE with a random MTP
                       layer carried untrained vs trained (model.mtp.enabled): as sft plus
                       mtp/loss and mtp/accuracy (MFU counts the MTP layer)
  grpo            ~68  engine.rl GRPO, HF rollout backend, bf16, rollout.check_weight_sync=true,
                       the demo model at hidden 512 / 8 layers / FFN 1536 and the addition
                       prompts, 16 x 8 per step, 3 steps: rollout/logprob_diff(_max),
                       debug/sync_logit_max_diff, the step-time split with time/weight_sync_s
                       (the HF backend's static KV cache and compiled decode step: rollout.hf.*
                       null, on with CUDA; timeout 300 s for the compilation)
  vision          ~40  the counting demo's Qwen3-VL, trained vision tower, text-only
                       micro-batches, parallel.overlap_grad_reduce at its default: losses and
                       grad norms, finite
  lora_grpo       ~83  grpo with model.lora.init_from a small non-zero peft adapter (B x 0.05)
  mfu             ~60  python -m tools.bench mfu --profile: the ~1.1B Qwen3-shaped engine step
                       (8 packed 4,096-token micro-batches): MFU, TFLOP/s, step s
  loss_head_32k   ~68  gpu_sft dense (the chunked loss head) at 32,768 tokens, vocabulary
                       151,936: step s and peak GiB (unchunked at 32K ran out of memory on an
                       H100: not run)
  moe_loop        ~78  gpu_sft moe_loop: the MoE with moe.grouped_experts=false
  fused           ~94  gpu_sft fused,moe_fused: dense and MoE with every model.fusions.* on
  loss_head       ~59  gpu_sft dense vs unchunked at 16,384 tokens, vocabulary 151,936
  spec_vllm      ~150  python -m tools.bench spec on mtp's GLM model: vLLM tokens/s with and
                       without MTP speculation (2 draft tokens), acceptance, greedy ids equal;
                       needs vLLM (CUDA wheel), skipped without it
  grpo_vllm_handle, grpo_vllm_file  ~75 each: grpo on rollout.backend=vllm with
                       rollout.sync_transport=handle | file (weight sync by handle vs by file);
                       skipped until vLLM's CUDA wheel can be carried and the key exists
Not in the default plan (name it in --items):
  grpo_hf_eager   ~68  grpo on the HF backend's eager loop (rollout.hf.static_cache=false,
                       compile=false): `--items grpo_hf_eager,grpo` is the static cache and
                       compiled decode's before/after (time/rollout_s, logprob_diff) in one call
  muon            ~55  gpu_sft muon: the dense case with optim.name=muon (megatron-core's Muon,
                       needs emerging-optimizers): step s, tokens/s, peak GiB; `--items
                       sft,muon` compares it with sft's dense (AdamW) in one call
  ladder         ~165  gpu_sft dense, eager (train.compile=false) and foreach
                       (optim.fused=false): the share of the two switchable step changes
                       (docs/benchmarks.md) in one call
  trl            ~540  python -m tools.bench trl: TRL 1.16's GRPO (shared and distinct prompts),
                       SFT and DPO trainers against the engine's defaults on the same model,
                       rows and sizes (tools/bench/trl.py), plus TRL's vLLM colocate mode and
                       rollout.backend=vllm where vLLM's CUDA build is installed: seconds per
                       step and stage, speedups over TRL (gpu/trl_item.py; needs trl;
                       above the default budget: --items trl --budget-s 600)
  tinker         ~100  python -m tools.bench tinker --backend hf, then --backend megatron: four
                       LoRA models' forward_backward calls through the tinker SDK, concurrent
                       (one batch) vs one after another, goal ratio <= 0.5 (docs/tinker.md): per
                       backend the ratio, its per-round quartiles, the largest batch's rows
                       (16 concurrent; gpu/tinker_item.py; needs the tinker SDK)
  varlen          ~40  tools/bench/gpu/varlen_check.py: packed rows (16,384 tokens, ~50
                       segments) through the core attention's varlen kernel against its
                       per-segment loop, causal / window / GQA / MHA, bf16: max abs
                       differences of output and gradients, errors against fp32, ms per
                       forward + backward each way (--cpu-smoke: the kernel's contract)

Budget (tools.bench.gpu.plan): the plan adds the estimates in order; an item whose estimate
does not fit what is left is skipped ("needs ~N s, M s left") and a later, shorter one may
still run; an item whose requirements are missing (CUDA, megatron-core, hydra-core,
transformers, peft for lora_grpo, emerging-optimizers for muon, vLLM and its CUDA wheel,
rollout.sync_transport) is skipped with that reason. Before each item the run decides again with the time really left; an item that
starts gets at most that time. Each item is one or more subprocesses under one timeout; a
failure or timeout is recorded and the next item still runs.

Output: OUT/results.json (the header, the plan, one record per item: status planned | ok |
failed | timeout | skipped, seconds, estimate, metrics, error or skip reason, commands; the
engine/peer ratios),
OUT/report.md (the Markdown table of the key numbers, the budget line and the environment
line: GPU, driver, versions, CPU, commit), both written at the start and after every item, so a
killed call keeps what finished; OUT/<item>.log (the tail of the item's output). Without CUDA
(and without --cpu-smoke) every item is skipped with that reason and it exits 0.

Modules: items (the commands, estimates, needs), plan (requirements and budget arithmetic),
runner (subprocesses, timeouts, the budget at run time), report (metrics read from each item's
files, the table, the ratios, the environment), output (results.json, report.md), prep (the
LoRA adapter, the mixed image/text rows, a tools.bench summary as a file), step_profile (one
engine step under torch.profiler), varlen_check (the varlen item's comparison), cli (the
flags).
"""
