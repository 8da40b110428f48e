"""`python -m engine.rl --config RECIPE --validate [--nodes M] [--gpus-per-node G]`: check an RL
recipe for a cluster shape without GPUs, weights or training (exit 0, or 2 listing problems).

It checks the configuration keys, the training layout for the model shape (model.hf_path's
config.json, else the model.shape preset) and the rollout engine placement, and prints the
placement (engines, GPUs per engine, owner ranks), what one weight sync moves (every engine
receives the whole model in model.dtype, HF tensors, unpadded vocabulary, once per RL step;
with rollout.sync_quantization=fp8 the published FP8 weights at 1 byte plus their scales:
engine.generation.engine_memory, which also checks that an SGLang engine's share of them fits
its mem_fraction and reports the KV cache left)
, the communication plan of one policy optimizer step (engine.config.comm_report: bytes each
GPU hands to collectives, by kind) plus the weight-sync bytes per engine, and an ESTIMATE of
the memory per GPU (GiB), in two phases:

- training: the policy's training peak (models.estimate.training_memory.estimate_memory for the
  policy layout, train.recompute*, and the micro-batches of one mini-batch of
  prompts_per_step x n / mini_batches_per_step responses of train.seq_length tokens), plus
  the frozen KL reference's weights (kl.beta > 0: the policy's stage parameters in
  model.dtype, no gradients or optimizer state; none with LoRA, whose policy estimate is
  models.estimate.lora_memory's and whose reference is the policy's own frozen base), the
  on-policy distillation teacher's weights
  (distill.teacher_path: its own config.json, its stage parameters at the policy's layout in
  model.dtype, frozen; when that directory is not on the validating machine the teacher is
  NOT counted, the report says so and recipe.expected_memory_gib is not compared; with
  distill.offload it is counted only in a third phase, its forward pass: the resident
  training state plus its weights), the reward model's weights (reward.model.path, counted as
  the teacher; with reward.model.offload in the rollout phase only, where it scores; on a
  disaggregated run on the training GPUs, while it scores a batch) and the PPO
  critic (advantage.estimator=gae: a second copy of the policy's stage parameters plus the
  value head, h / tp + 1 parameters on the last stage, with its own fp32 gradients and
  optimizer state; the policy's output layer, frozen in the critic, has neither; on the
  pipeline stage of the policy's peak);
- rollout, on an engine's GPUs: the resident training state (weights, fp32 gradient buffers,
  optimizer state, the reference, the teacher unless offloaded, the critic, the runtime) plus
  the engine (engine.generation.engine_memory.engine_budget): SGLang takes
  rollout.sglang.mem_fraction of the GPU (weights and KV cache), vLLM
  rollout.vllm.gpu_memory_utilization of it (or its share of the weights plus
  rollout.vllm.kv_cache_gib); the HF backend holds the whole model in model.dtype on its owner
  rank. Without
  rollout.sleep_during_train the engine's memory stays during training too, and counts in the
  training phase.

The larger phase is the peak; it must fit recipe.gpu_memory_gib (a problem otherwise, a
warning over 90 %) and match recipe.expected_memory_gib within 10 % when that is stated.
`--json` prints one JSON object instead (summary, problems, ok, communication).
"""
from __future__ import annotations

import json
import sys

from engine.config.cli_flags import int_flag, pop_switch
from engine.config.comm_report import comm_section
from models.estimate.lora_memory import lora_summary
from engine.config.vision_settings import vision_estimate, vision_summary
from models.estimate.vision import tower_parameters
from engine.config.lora_settings import lora_problems, lora_spec
from engine.config.loading import load_config
from engine.config.micro_batch_defaults import resolved_train
from engine.config.recipe_validation import estimate_memory, memory_checks, model_config
from engine.config.schema import ConfigError, layout_problems, parallel_layout, value_problems
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.disaggregated.checks import async_problems
from engine.rl.checks import ppo_problems, rl_problems
from engine.rl.config import RLConfig
from engine.rl.policy.frozen_memory import frozen_config, frozen_memory
from engine.rl.policy.reward_model_checks import reward_model_fit
from engine.generation.engine_memory import (engine_budget, engine_fit, engine_weights,
                                              engine_weights_problem)
from engine.generation.placement import placement_problems, resolve_placement, split_sizes
from engine.generation.sync.quantization import sync_quantization_problems
from engine.training.plan import plan_mini_batch
from models.estimate.counting import padded_vocab_size, stage_parameters
from models.estimate.training_memory import GIB, micro_batch_tokens, optimizer_bytes

GB = 1e9


def critic_memory(cfg: RLConfig, hf: dict, layout, mem) -> tuple[float, list[str]]:
    """(GiB per GPU, report lines) of the PPO critic's resident state on the pipeline stage of
    the policy's peak `mem`: the policy's stage parameters (its output layer frozen: no
    gradient or optimizer state) plus the value head, h / tp + 1 parameters on the last
    stage, with fp32 gradients and the optimizer state of trainable parameters."""
    if cfg.advantage.estimator != "gae":
        return 0.0, []
    a, tp, h = _bytes(cfg), layout.tp, hf["hidden_size"]
    stage = stage_parameters(hf, tp, layout.pp, layout.ep)
    last = mem.notes["last_stage"]
    params = stage.last_stage if last else stage.first_stage
    head = h // tp + 1 if last else 0
    tied = bool(hf.get("tie_word_embeddings", False))
    frozen = padded_vocab_size(hf["vocab_size"], tp) * h // tp if last and not tied else 0
    per_param = optimizer_bytes(a == 2, layout, cfg.optim.distributed_optimizer)
    weights = (params + head) * a / GIB
    grads = (params - frozen + head) * 4 / GIB
    optimizer = mem.optimizer + (head - frozen) * per_param / GIB
    gib = weights + grads + optimizer
    where = (f"the policy's last-stage parameters + the value head ({head} parameters); its "
             f"frozen output layer ({frozen / 1e9:.2f} B) has no gradients or optimizer state"
             if last else "the policy's first-stage parameters, the stage of its peak")
    return gib, [f"PPO critic per GPU (estimate, GiB): weights {weights:.1f} + grads "
                 f"{grads:.1f} + optimizer {optimizer:.1f} = {gib:.1f} ({where})"]


def _bytes(cfg: RLConfig) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4


def reference_gib(cfg: RLConfig, hf: dict, a: int, lora) -> float:
    """GiB per GPU of the frozen KL reference (kl.beta > 0): the fuller pipeline stage of
    one TP rank, a vision tower whole on stage 0; none with LoRA (the reference is the
    policy's frozen base)."""
    if cfg.kl.beta <= 0 or lora is not None:
        return 0.0
    stage = stage_parameters(hf, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    return max(stage.first_stage + tower_parameters(hf), stage.last_stage) * a / GIB


def rl_memory(cfg: RLConfig, hf: dict, world: int, teacher: dict | None = None,
              gpus_per_engine: int = 1, rm: dict | None = None
              ) -> tuple[float, float, list[str]]:
    """(training GiB, rollout GiB, summary lines) per GPU: the module docstring's estimate;
    `teacher` / `rm`: distill.teacher_path's / reward.model.path's HF config (frozen_config),
    None when not counted; `gpus_per_engine`: the placement's (an engine's share of its weights
    per GPU)."""
    par, train, roll = cfg.parallel, resolved_train(cfg, hf), cfg.rollout
    layout = parallel_layout(par, world)
    responses = max(train.prompts_per_step * roll.n // train.mini_batches_per_step, 1)
    plan = plan_mini_batch([train.seq_length] * responses, layout.dp, train.balance_dp,
                           train.micro_batch_size, train.max_tokens_per_micro_batch)
    a = 2 if cfg.model.dtype == "bfloat16" else 4
    lora = lora_spec(cfg, hf)  # LoRA: adapters trained, and the KL reference is the frozen base
    mem = estimate_memory(hf, layout, train, a == 2, cfg.optim.distributed_optimizer,
                          plan.num_micro_batches, lora, vision_estimate(cfg, train),
                          muon=cfg.optim.name == "muon")
    reference = reference_gib(cfg, hf, a, lora)
    engine, engine_text = engine_budget(cfg, hf, gpus_per_engine)
    teacher_gib, teacher_lines = frozen_memory(cfg, cfg.distill.teacher_path,
                                               "distill.teacher_path", teacher,
                                               "distillation teacher")
    rm_gib, rm_lines = frozen_memory(cfg, cfg.reward.model.path, "reward.model.path", rm,
                                     "reward model")
    # reward.model.offload: on the GPU only while it scores, in the rollout phase (colocated)
    rm_host = cfg.reward.model.offload and rm is not None
    full = mem if lora is None else estimate_memory(  # the PPO critic is a full model
        hf, layout, train, a == 2, cfg.optim.distributed_optimizer, plan.num_micro_batches)
    critic, critic_lines = critic_memory(cfg, hf, layout, full)
    # distill.offload: the teacher is on the GPU only for its forward pass (the log-prob stage)
    offloaded = cfg.distill.offload and teacher is not None
    resident_teacher = 0.0 if offloaded else teacher_gib
    others = reference + resident_teacher + critic + (0.0 if rm_host else rm_gib)
    resident = mem.weights + mem.grads + mem.optimizer + others + mem.runtime
    training = mem.total + others + (0.0 if roll.sleep_during_train else engine)
    rollout = resident + engine + (rm_gib if rm_host else 0.0)
    if offloaded:  # its forward pass: the resident training state plus the teacher's weights
        stage = resident + teacher_gib + (0.0 if roll.sleep_during_train else engine)
        teacher_lines.append(f"distill.offload: the teacher is in host memory except during "
                             f"the log-prob stage, whose peak per GPU (estimate, GiB) is the "
                             f"resident training state {resident:.1f} + teacher "
                             f"{teacher_gib:.1f} = {stage:.1f}")
        training = max(training, stage)
    lines = [
        *lora_summary(hf, lora, stage_parameters(hf, 1, 1).total),
        *vision_summary(cfg, hf, train), *teacher_lines, *rm_lines, *critic_lines,
        f"memory per GPU while training (estimate, GiB): policy {mem.total:.1f} (weights "
        f"{mem.weights:.1f} + grads {mem.grads:.1f} + optimizer {mem.optimizer:.1f} + "
        f"activations {mem.activations:.1f} + logits {mem.logits:.1f} + runtime "
        f"{mem.runtime:.1f}) + KL reference {reference:.1f}"
        + ((" (the starting adapter of model.lora.init_from, a frozen rank-r copy)"
            if cfg.model.lora.init_from else " (the policy's frozen base, adapters off)")
           if lora and cfg.kl.beta > 0 else "")
        + (f" + distillation teacher {teacher_gib:.1f}" if teacher is not None
           and not offloaded else "")
        + (f" + PPO critic {critic:.1f}" if critic_lines else "")
        + (f" + reward model {rm_gib:.1f}" if rm is not None and not rm_host else "")
        + ("" if roll.sleep_during_train else f" + rollout engine {engine:.1f}")
        + f" = {training:.1f}",
        f"memory per GPU during rollout on an engine's GPUs (estimate, GiB): resident "
        f"training state {resident:.1f} + engine {engine:.1f} ({engine_text})"
        + (f" + reward model {rm_gib:.1f} (reward.model.offload: on the GPU while it scores)"
           if rm_host else "") + f" = {rollout:.1f}",
    ]
    return training, rollout, lines


def disaggregated_memory(cfg: RLConfig, hf: dict, world: int, rm: dict | None = None
                         ) -> tuple[float, float, list[str]]:
    """(training GiB, rollout GiB, lines) per GPU when the engines have their own ranks: the
    training GPUs hold the policy (and reference, and the reward model: `rm`, as rl_memory's;
    with reward.model.offload only while it scores a batch, before the step's training), the
    rollout GPUs only the engine."""
    r = cfg.rollout
    a = 2 if cfg.model.dtype == "bfloat16" else 4
    layout = parallel_layout(cfg.parallel, world)
    train = resolved_train(cfg, hf)
    responses = max(train.prompts_per_step * r.n // train.mini_batches_per_step, 1)
    plan = plan_mini_batch([train.seq_length] * responses, layout.dp,
                           train.balance_dp, train.micro_batch_size,
                           train.max_tokens_per_micro_batch)
    lora = lora_spec(cfg, hf)
    mem = estimate_memory(hf, layout, train, a == 2, cfg.optim.distributed_optimizer,
                          plan.num_micro_batches, lora, vision_estimate(cfg, train),
                          muon=cfg.optim.name == "muon")
    reference = reference_gib(cfg, hf, a, lora)
    engine = stage_parameters(hf, 1, 1).total * a / GIB  # hf backend: the whole model
    rm_gib, lines = frozen_memory(cfg, cfg.reward.model.path, "reward.model.path", rm,
                                  "reward model")
    host = cfg.reward.model.offload
    trainer = mem.total + reference + (0.0 if host else rm_gib)
    scoring = mem.weights + mem.grads + mem.optimizer + mem.runtime + reference + rm_gib
    lines += [
        f"memory per training GPU (estimate, GiB): policy {mem.total:.1f} + KL reference "
        f"{reference:.1f}" + (f" + reward model {rm_gib:.1f}" if rm and not host else "")
        + f" = {trainer:.1f}" + (f"; while the reward model scores a batch (offloaded "
                                 f"otherwise) {scoring:.1f}" if rm and host else ""),
        f"memory per rollout GPU (estimate, GiB): {r.backend} engine weights {engine:.1f}",
        f"host memory per engine owner (estimate, GiB): {2 * engine:.1f} (the served version, "
        "kept for engine restarts, plus one version received ahead; engine.rl.disaggregated.inbox)"]
    if r.check_behaviour_logprobs and r.max_staleness >= 1:
        shard = mem.grads * a / 4  # a rank's trainable parameters (fp32 grads) in model.dtype
        lines.append(f"host memory per training rank for rollout.check_behaviour_logprobs "
                     f"(estimate, GiB): {(r.max_staleness + 1) * shard:.1f} ({r.max_staleness} "
                     "kept version(s) of its trainable shard, plus its current values during "
                     "each step's swap; engine.rl.disaggregated.behaviour_check)")
    return max(trainer, scoring if rm and host else 0.0), engine, lines


def rl_comm(cfg: RLConfig, hf: dict, world: int, engines: int) -> tuple[list[str], dict]:
    """Communication lines and JSON of one policy optimizer step (a mini-batch of
    prompts_per_step x n / mini_batches_per_step responses of train.seq_length tokens), plus
    the weight sync: every engine receives the whole model once per RL step (model.dtype, or
    FP8 + scales: engine.generation.engine_memory)."""
    t, r = resolved_train(cfg, hf), cfg.rollout
    layout = parallel_layout(cfg.parallel, world)
    responses = max(t.prompts_per_step * r.n // t.mini_batches_per_step, 1)
    plan = plan_mini_batch([t.seq_length] * responses, layout.dp, t.balance_dp,
                           t.micro_batch_size, t.max_tokens_per_micro_batch)
    lines, data = comm_section(cfg, hf, layout, micro_batch_tokens(t), plan.num_micro_batches)
    sync = engine_weights(cfg, hf).bytes
    data["weight_sync"] = {"bytes_per_engine": sync, "engines": engines,
                           "per_rl_step": True}
    data["optimizer_steps_per_rl_step"] = t.mini_batches_per_step * t.epochs_per_rollout
    return lines + [f"weight sync per RL step: {sync / GB:.2f} GB into each of {engines} "
                    "engine(s) (derived)"], data


def rl_recipe_report(cfg: RLConfig, nodes: int, per_node: int
                     ) -> tuple[list[str], list[str], dict]:
    """(summary lines, problems, JSON data: the communication plan) of running `cfg` on
    `nodes` x `per_node` GPUs."""
    problems = value_problems(cfg) + rl_problems(cfg) + ppo_problems(cfg)
    world = nodes * per_node
    if nodes < 1 or per_node < 1:
        return [], problems + [f"--nodes {nodes} and --gpus-per-node {per_node} must be >= 1"], {}
    hf = model_config(cfg, problems)
    if hf is None:
        return [], problems, {}
    problems += async_problems(cfg, world, per_node)
    world, n_roll = split_sizes(cfg, world)  # the training ranks from here on
    problems += (layout_problems(cfg, world, hf) + lora_problems(cfg, hf)
                 + sync_quantization_problems(cfg, hf)
                 + [p for p in [engine_weights_problem(cfg, hf)] if p])
    teacher = frozen_config(cfg.distill.teacher_path, "distill.teacher_path", problems)
    if teacher is not None:
        problems += [f"distill.teacher_path={cfg.distill.teacher_path}: {m}"
                     for m in layout_problems(cfg, world, teacher)]
    rm = frozen_config(cfg.reward.model.path, "reward.model.path", problems)
    if rm is not None:
        problems += reward_model_fit(cfg, world, hf, rm)  # config.json: weights may be absent
    roll = cfg.rollout
    engine_ranks = n_roll or world
    placement_issues = placement_problems(roll.num_engines, roll.gpus_per_engine, engine_ranks,
                                          per_node)
    if problems or placement_issues:
        return [], problems + placement_issues, {}
    placement = resolve_placement(roll.num_engines, roll.gpus_per_engine, engine_ranks, per_node)
    params = stage_parameters(hf, 1, 1).total
    sync = engine_weights(cfg, hf)
    sync_bytes = sync.bytes
    par = cfg.parallel
    ep = f" ep={par.ep}" if par.ep > 1 else ""
    training, rollout, memory_lines = rl_memory(cfg, hf, world, teacher,
                                                placement.gpus_per_engine, rm)
    if n_roll:  # the engines live on their own GPUs: no resident training state there
        training, rollout, memory_lines = disaggregated_memory(cfg, hf, world, rm)
    at_recipe_size = ((nodes, per_node) == (cfg.recipe.nodes, cfg.recipe.gpus_per_node)
                      and (teacher is not None or not cfg.distill.teacher_path)
                      and (rm is not None or not cfg.reward.model.path))
    memory_issues, warnings = memory_checks(
        max(training, rollout), cfg.recipe, at_recipe_size, "estimated peak memory per GPU",
        "raise tp/pp/ep, lower train.max_tokens_per_micro_batch or " + (
            "rollout.vllm.gpu_memory_utilization" if roll.backend == "vllm"
            else "rollout.sglang.mem_fraction"),
        "the estimated peak is")
    fit_issues, fit_lines = engine_fit(cfg, hf, placement.gpus_per_engine)
    memory_issues += fit_issues
    summary = [
        f"model: {cfg.model.shape or hf.get('model_type')}, {params / 1e9:.2f} B parameters, "
        f"dtype {cfg.model.dtype}",
        f"training layout: tp={par.tp} pp={par.pp} cp={par.cp}{ep} "
        f"dp={world // (par.tp * par.pp * par.cp)} on {nodes} node(s) x {per_node} GPUs",
        *([f"placement: disaggregated, training on ranks [0, {world}) ({world // per_node} "
           f"node(s)), rollout on ranks [{world}, {world + n_roll}) ({n_roll // per_node} "
           f"node(s)); rollout.max_staleness={roll.max_staleness}"] if n_roll else []),
        f"rollout: backend {roll.backend}, {placement.describe()}"
        + (" (ranks within the rollout side)" if n_roll else ""),
        f"weight sync per RL step: {sync_bytes / GB:.1f} GB to each of "
        f"{placement.num_engines} engine(s) ({placement.num_engines * sync_bytes / GB:.1f} GB "
        f"in all, {sync.text}), each engine fed from its own model replica",
        f"rollout batch: {cfg.train.prompts_per_step} prompts x {roll.n} responses, about "
        f"{cfg.train.prompts_per_step * roll.n / placement.num_engines:.0f} responses per engine",
        *memory_lines, *fit_lines, *(f"warning: {w}" for w in warnings),
    ]
    comm_lines, comm = rl_comm(cfg, hf, world, placement.num_engines)
    return summary + comm_lines, memory_issues, {"communication": comm}


def rl_validate_main(argv: list[str]) -> int:
    """CLI of `--validate` for engine.rl: prints the summary (exit 0) or the problems (2)."""
    argv = [a for a in argv if a != "--validate"]
    as_json = pop_switch(argv, "--json")
    try:
        nodes = int_flag(argv, "--nodes")
        per_node = int_flag(argv, "--gpus-per-node")
        cfg, _ = load_config(RLConfig, argv)
        apply_algorithm_defaults(cfg, explicit_keys(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    nodes = nodes if nodes is not None else cfg.recipe.nodes
    per_node = per_node if per_node is not None else cfg.recipe.gpus_per_node
    summary, problems, data = rl_recipe_report(cfg, nodes, per_node)
    if as_json:
        print(json.dumps({"ok": not problems, "nodes": nodes, "gpus_per_node": per_node,
                          "summary": summary, "problems": problems,
                          **data}, indent=1), flush=True)
        return 2 if problems else 0
    for line in summary:
        print(line)
    if problems:
        print(f"recipe INVALID on {nodes} node(s) x {per_node} GPUs:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        sys.stderr.flush()
        return 2
    print(f"recipe OK on {nodes} node(s) x {per_node} GPUs", flush=True)
    return 0
