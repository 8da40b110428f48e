"""`python -m engine.sft --config RECIPE --validate [--world-size N] [--nodes M]`: check a
recipe's layout arithmetic and memory for a cluster shape, without weights, GPUs or processes.

The model shape comes from `model.hf_path` (its config.json) when given, else from the preset
named by `model.shape` (models.families.presets.MODEL_SHAPES: the public HF configs of the recipe models). Defaults:
`--nodes` = recipe.nodes, `--gpus-per-node` = recipe.gpus_per_node, `--world-size` = their
product. Exit 0 with a summary, or 2 with every problem.

Memory per GPU (GiB = 2^30 bytes) is an estimate for the engine's GPU path (megatron DDP with
fp32 gradient buffers, flash SDPA; TP sequence parallelism and activation recomputation as
configured, engine.config.model_settings):

- weights: parameters of the fullest pipeline stage on one TP rank x 2 bytes (bf16) or 4;
- grads: the same count x 4 bytes (`grad_reduce_in_fp32`);
- optimizer: x 12 bytes in bf16 (fp32 master + Adam m, v) or x 8 in fp32 (Adam m, v), divided
  by dp x cp with the distributed optimizer;
- activations: per layer and micro-batch, t = tokens of the micro-batch / cp and
  bytes = a x t x (4 h / s + (q_rot + kv_rep + attn_out + 2 kv + 3 ffn) / tp) with a = 2
  (bf16) or 4 (q, kv = query and key/value widths; kv_rep = 2 q when GQA repeats KV heads for
  SDPA, the attention core's own copy; MLA and the Qwen3.5 hybrids' GDN and gated attention
  layers: their own terms, models.estimate.memory, the hybrids' averaged over the layers);
  s = tp with sequence parallelism (norm inputs and residuals split over TP), else 1; times
  the layers in flight on pipeline stage 0 (1F1B: min(pp, M) micro-batches of L/pp layers; interleaved: min(M vpp, 2(pp-1) + (vpp-1)pp + 1)
  chunks of L/(pp vpp) layers). Recomputation: `selective` drops kv_rep (the attention core is
  recomputed from q, k, v, which stay); `full` keeps only each recomputed layer's input,
  a x t x h / s: with `uniform` groups of n = recompute_num_layers layers one input per group
  (passes / n inputs) plus one group's full activations n x per-layer while it is recomputed
  in the backward pass; with `block` the first n of the c layers of each chunk keep only their
  input, the other c - n keep everything, plus one layer's full activations while recomputed;
- MoE models (parallel.ep): each rank holds num_experts / ep experts split over tp; their
  optimizer state is sharded over the expert-data-parallel group (dp x cp / ep ranks) instead
  of dp x cp; a layer's MLP activations are k x (3 moe_ffn / tp + 2 h) per token (the k
  routed copies: each expert's SwiGLU, the permuted input and output) plus 3 shared / tp
  (a shared expert's SwiGLU) instead of 3 ffn / tp;
- attention scores: none with flash SDPA; a family whose attention materialises them
  (gpt-oss's sinks: models.layers.attention.sinks) adds its `attention_score_elements` per token
  (seq_length x heads / tp: every head's row of probabilities, kept for the backward pass) to
  each layer's activations, plus 3 such copies once (the transient scores of the layer being
  computed);
- logits (last stage): with the chunked loss head (train.loss_chunk_tokens = c, the default)
  12 x min(c, t) x padded vocab / tp bytes (about three fp32 chunk buffers) plus the output
  weight's gradient accumulated in fp32 and cast, padded vocab / tp x h x (4 + a); unchunked
  t x padded vocab / tp x (a + 12) (bf16/fp32 logits, the fp32 copy, the masked copy and its
  gradient in the vocab-parallel cross-entropy);
- runtime: RUNTIME_OVERHEAD_GIB for the CUDA context, NCCL buffers and allocator slack;
- LoRA (model.lora.rank > 0): frozen base, trained adapters (models.estimate.lora_memory).

The communication plan (models.estimate.comm, engine.config.comm_report) follows: bytes each
GPU hands to collectives per optimizer step, by kind. `--json` prints one JSON object instead
of text: summary, warnings, problems, ok, world_size, nodes, memory_gib and communication.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

from engine.config.schema import (ConfigError, SFTConfig, data_file_problems, layout_problems,
                           load_config, parallel_layout, read_model_config, sft_problems,
                           value_problems)
from engine.config.cli_flags import int_flag, pop_switch
from engine.config.comm_report import comm_section
from models.estimate.lora_memory import adapter_activation_bytes, lora_summary, with_adapters
from engine.config.lora_settings import lora_problems, lora_spec
from engine.config.model_settings import recompute_layer_problems, recompute_settings
from engine.training.plan import plan_mini_batch
from models.estimate.memory import logits_bytes, mixer_bytes
from models.families.registry import family_of, moe_family
from models.estimate.counting import stage_parameters
from models.families.presets import MODEL_SHAPES, shape_mismatches

GIB = 2 ** 30
RUNTIME_OVERHEAD_GIB = 4.0
WARN_FRACTION = 0.9          # warn when the estimate exceeds this share of GPU memory
EXPECTED_TOLERANCE = 0.10    # recipe.expected_memory_gib must be within 10% of the estimate

@dataclass
class MemoryEstimate:
    """Estimated peak GiB per GPU on the fullest pipeline stage, by component."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    runtime: float = RUNTIME_OVERHEAD_GIB
    notes: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.runtime)


def micro_batch_tokens(train) -> int:
    """Tokens in the largest micro-batch: the token budget (a longer sequence still fits alone)
    or micro_batch_size full-length sequences."""
    if train.max_tokens_per_micro_batch:
        return max(train.max_tokens_per_micro_batch, train.seq_length)
    return train.micro_batch_size * train.seq_length


def optimizer_bytes(bf16: bool, layout, distributed_optimizer: bool) -> float:
    """Optimizer-state bytes per (non-expert) trainable parameter on one GPU (module docstring)."""
    return (12 if bf16 else 8) / (layout.dp * layout.cp if distributed_optimizer else 1)


def estimate_memory(hf: dict, layout, train, bf16: bool, distributed_optimizer: bool,
                    micro_batches: int, lora=None) -> MemoryEstimate:
    """Per-GPU peak estimate (formulas in the module docstring) for `layout`
    (a parallel.layout.ParallelLayout, its `sequence_parallel` resolved) and `micro_batches`
    per DP rank per step; `train` gives the micro-batch size and train.recompute*; `lora` (a
    models.lora.adapters.LoraSpec): frozen base + adapters (models.estimate.lora_memory)."""
    tp, pp, cp, vpp = layout.tp, layout.pp, layout.cp, layout.vpp or 1
    granularity, method, group = recompute_settings(train)
    s = tp if layout.sequence_parallel and tp > 1 else 1
    params = stage_parameters(hf, tp, pp, layout.ep)
    a = 2 if bf16 else 4
    h, ffn = hf["hidden_size"], hf.get("intermediate_size") or 0
    moe = moe_family(hf)  # None for dense models
    mlp = (moe.experts_per_token(hf) * (3 * moe.expert_width(hf) / tp + 2 * h)
           + 3 * moe.shared_expert_width(hf) / tp
           if moe and params.expert_stage else 3 * ffn / tp)
    t = micro_batch_tokens(train) / cp
    scores = family_of(hf).attention_score_elements(hf, train.seq_length, tp)  # gpt-oss
    per_layer = t * (a * (4 * h / s + mlp + scores)
                     + mixer_bytes(hf, tp, s, a, granularity != "selective"))
    per_layer += adapter_activation_bytes(hf, lora, a, t, s)   # 0 without LoRA
    layer_input = a * t * h / s
    layers = hf["num_hidden_layers"]
    if pp == 1:
        first_layers = layers
    elif vpp == 1:
        first_layers = min(pp, micro_batches) * (layers // pp)
    else:
        chunks = min(micro_batches * vpp, 2 * (pp - 1) + (vpp - 1) * pp + 1)
        first_layers = chunks * (layers // (pp * vpp))
    logits = logits_bytes(hf, t, tp, a, getattr(train, "loss_chunk_tokens", None))
    opt_bytes = optimizer_bytes(bf16, layout, distributed_optimizer)
    expert_opt_bytes = opt_bytes * (layout.ep if distributed_optimizer else 1)

    chunk_layers = layers // (pp * vpp)

    def activation_bytes(passes: float) -> float:
        """Kept activations of `passes` layer passes, plus what recomputation rebuilds."""
        if granularity != "full":
            return passes * per_layer
        if method == "uniform":
            return passes / group * layer_input + group * per_layer
        kept = min(group, chunk_layers) / chunk_layers
        return passes * (kept * layer_input + (1 - kept) * per_layer) + per_layer

    def stage(n_params: int, act_layers: float, with_logits: bool) -> MemoryEstimate:
        est = MemoryEstimate(weights=n_params * a / GIB, grads=n_params * 4 / GIB,
                             optimizer=((n_params - params.expert_stage) * opt_bytes
                                        + params.expert_stage * expert_opt_bytes) / GIB,
                             activations=(activation_bytes(act_layers)
                                          + 3 * a * t * scores) / GIB,
                             logits=logits / GIB if with_logits else 0.0,
                             notes={"layers_in_flight": act_layers, "tokens_per_rank": t,
                                    "last_stage": with_logits,
                                    "per_layer_bytes": per_layer,
                                    "layer_input_bytes": layer_input})
        return est if lora is None else with_adapters(
            est, n_params, hf, layout, lora, a, opt_bytes, expert_opt_bytes, with_logits)

    first = stage(params.first_stage, first_layers, pp == 1)
    if pp == 1:
        return first
    last = stage(params.last_stage, layers // pp, True)
    return max(first, last, key=lambda m: m.total)


def memory_checks(estimate: float, recipe, at_recipe_size: bool, what: str, fix: str,
                  stated_vs: str) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a per-GPU estimate (GiB) against recipe.gpu_memory_gib (over
    it: a problem naming `fix`; over WARN_FRACTION of it: a warning) and, at the recipe's own
    cluster size, recipe.expected_memory_gib (off by more than EXPECTED_TOLERANCE: a problem).
    `what` names the estimate ("estimated memory per GPU"), `stated_vs` how the mismatch
    message names it ("the estimate for 2 node(s) is")."""
    cap, stated = recipe.gpu_memory_gib, recipe.expected_memory_gib
    problems, warnings = [], []
    if estimate > cap:
        problems.append(f"{what} {estimate:.1f} GiB exceeds recipe.gpu_memory_gib={cap}: {fix}")
    elif estimate > WARN_FRACTION * cap:
        warnings.append(f"{what} {estimate:.1f} GiB is over {WARN_FRACTION:.0%} of {cap} GiB")
    if stated is not None and at_recipe_size and abs(stated - estimate) > (
            EXPECTED_TOLERANCE * estimate):
        problems.append(f"recipe.expected_memory_gib={stated} but {stated_vs} "
                        f"{estimate:.1f} GiB; update the recipe")
    return problems, warnings


@dataclass
class RecipeReport:
    summary: list[str]
    problems: list[str]
    warnings: list[str]
    data: dict = field(default_factory=dict)   # memory_gib, communication (for --json)


def model_config(cfg, problems: list[str]) -> dict | None:
    preset = MODEL_SHAPES.get(cfg.model.shape) if cfg.model.shape else None
    if cfg.model.shape and preset is None:
        problems.append(f"model.shape={cfg.model.shape!r} is not a known preset; choose one "
                        f"of {', '.join(MODEL_SHAPES)}")
    if cfg.model.hf_path:
        try:
            hf = read_model_config(cfg)
        except ConfigError as e:
            problems.append(str(e))
            return None
        if preset is not None:
            problems += [f"model.shape={cfg.model.shape} does not match model.hf_path: {m}"
                         for m in shape_mismatches(preset, hf)]
        return hf
    if preset is None and not cfg.model.shape:
        problems.append("give model.shape (one of " + ", ".join(MODEL_SHAPES) + ") or "
                        "model.hf_path so the model shape is known")
    return preset


def validate_recipe(cfg, world_size: int, nodes: int) -> RecipeReport:
    """Every problem and warning of running `cfg` on `nodes` nodes with `world_size` GPUs."""
    problems = (value_problems(cfg) + sft_problems(cfg)
                + data_file_problems(cfg, require_train=False))
    warnings: list[str] = []
    if not cfg.data.train_files:
        warnings.append("data.train_files is not set (required to train)")
    if not isinstance(nodes, int) or nodes < 1 or world_size < 1 or world_size % nodes:
        problems.append(f"world size {world_size} is not a positive multiple of --nodes {nodes}")
        return RecipeReport([], problems, warnings)
    hf = model_config(cfg, problems)
    if hf is None:
        return RecipeReport([], problems, warnings)
    layout_issues = (layout_problems(cfg, world_size, hf) + lora_problems(cfg, hf)
                     + recompute_layer_problems(cfg.parallel, cfg.train,
                                                hf["num_hidden_layers"]))
    if layout_issues:
        return RecipeReport([], problems + layout_issues, warnings)
    p = cfg.parallel
    layout = parallel_layout(p, world_size)
    per_node = world_size // nodes
    if per_node % (p.tp * p.cp):
        warnings.append(f"tp x cp = {p.tp * p.cp} does not fit inside one node of {per_node} "
                        "GPUs: tensor/context-parallel traffic crosses the network")
    train = cfg.train
    if train.global_batch_size < layout.dp:
        warnings.append(f"train.global_batch_size={train.global_batch_size} < dp={layout.dp}: "
                        "some DP ranks only run empty micro-batches")
    plan = plan_mini_batch([train.seq_length] * train.global_batch_size, layout.dp,
                           train.balance_dp, train.micro_batch_size,
                           train.max_tokens_per_micro_batch)
    m = plan.num_micro_batches
    if p.pp > 1 and m < p.pp:
        warnings.append(f"{m} micro-batches per step < parallel.pp={p.pp}: the pipeline "
                        "bubble dominates; raise train.global_batch_size")
    if train.seq_length > hf.get("max_position_embeddings", train.seq_length):
        warnings.append(f"train.seq_length={train.seq_length} exceeds the model's "
                        f"max_position_embeddings={hf['max_position_embeddings']}")
    bf16 = cfg.model.dtype == "bfloat16"
    mem = estimate_memory(hf, layout, train, bf16, cfg.optim.distributed_optimizer, m,
                          lora_spec(cfg))
    cap = cfg.recipe.gpu_memory_gib
    at_recipe_size = (nodes == cfg.recipe.nodes
                      and world_size == cfg.recipe.nodes * cfg.recipe.gpus_per_node)
    too_big, near = memory_checks(
        mem.total, cfg.recipe, at_recipe_size, "estimated memory per GPU",
        "raise tp/pp/cp or lower train.micro_batch_size / max_tokens_per_micro_batch",
        f"the estimate for {nodes} node(s) is")
    problems += too_big
    warnings += near
    params = stage_parameters(hf, p.tp, p.pp, p.ep)
    tokens = train.global_batch_size * train.seq_length
    active = (f" ({params.active / 1e9:.2f} B active per token, "
              f"{params.expert_stage / 1e9:.2f} B expert parameters per GPU)"
              if params.expert_stage else "")
    name = cfg.model.shape or hf.get("model_type")
    summary = [
        f"model: {name}, {params.total / 1e9:.2f} B parameters{active}, "
        f"{hf['num_hidden_layers']} "
        f"layers, dtype {cfg.model.dtype}",
        f"layout: {layout.describe()} on {nodes} node(s) x {per_node} GPUs; "
        f"{params.layers_per_stage} layers per pipeline stage",
        f"batch: {train.global_batch_size} sequences x {train.seq_length} tokens = {tokens} "
        f"tokens per step (at most); {m} micro-batches per DP rank per step, "
        f"{micro_batch_tokens(train)} tokens per micro-batch",
        f"activations: sequence parallelism {'on' if layout.sequence_parallel else 'off'}, "
        f"recompute {_recompute_text(train)}", *lora_summary(hf, lora_spec(cfg), params.total),
        f"memory per GPU (estimate, GiB): weights {mem.weights:.1f} + grads {mem.grads:.1f} "
        f"+ optimizer {mem.optimizer:.1f} + activations {mem.activations:.1f} "
        f"({mem.notes['layers_in_flight']:g} layer passes of {mem.notes['tokens_per_rank']:g} "
        f"tokens) + logits {mem.logits:.1f} + runtime {mem.runtime:.1f} = {mem.total:.1f} "
        f"of {cap}",
    ]
    comm_lines, comm = comm_section(cfg, hf, layout, micro_batch_tokens(train), m)
    memory = {k: v for k, v in asdict(mem).items() if k != "notes"}
    return RecipeReport(summary + comm_lines, problems, warnings,
                        {"memory_gib": {**memory, "total": mem.total}, "communication": comm})


def _recompute_text(train) -> str:
    granularity, method, layers = recompute_settings(train)
    return f"full ({method}, {layers} layer(s))" if granularity == "full" else granularity


def validate_main(argv: list[str]) -> int:
    """CLI of `--validate`: prints the summary (exit 0) or the problems (exit 2)."""
    argv = [a for a in argv if a != "--validate"]
    as_json = pop_switch(argv, "--json")
    try:
        world = int_flag(argv, "--world-size")
        nodes = int_flag(argv, "--nodes")
        per_node = int_flag(argv, "--gpus-per-node")
        cfg, _ = load_config(SFTConfig, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    nodes = nodes if nodes is not None else cfg.recipe.nodes
    per_node = per_node if per_node is not None else cfg.recipe.gpus_per_node
    world = world if world is not None else nodes * per_node
    report = validate_recipe(cfg, world, nodes)
    if as_json:
        print(json.dumps({"ok": not report.problems, "world_size": world, "nodes": nodes,
                          "summary": report.summary, "warnings": report.warnings,
                          "problems": report.problems, **report.data}, indent=1), flush=True)
        return 2 if report.problems else 0
    for line in report.summary:
        print(line)
    for w in report.warnings:
        print(f"warning: {w}")
    if report.problems:
        print(f"recipe INVALID for world size {world} on {nodes} node(s):", file=sys.stderr)
        for p in report.problems:
            print(f"  - {p}", file=sys.stderr)
        sys.stderr.flush()
        return 2
    print(f"recipe OK for world size {world} on {nodes} node(s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(validate_main(sys.argv[1:]))
