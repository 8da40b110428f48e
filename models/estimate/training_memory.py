"""The per-GPU memory peak of a training layout, summed over the fullest pipeline stage
(`estimate_memory`, for `--validate`: engine.config.recipe_validation, engine.rl.recipe_check).

Memory per GPU (GiB = 2^30 bytes) is an estimate for the engine's GPU path (megatron DDP with
fp32 gradient buffers, flash SDPA; TP sequence parallelism and activation recomputation as
configured, engine.config.model_settings):

- weights: parameters of the fullest pipeline stage on one TP rank x 2 bytes (bf16) or 4;
- grads: the same count x 4 bytes (`grad_reduce_in_fp32`);
- optimizer: x 12 bytes in bf16 (fp32 master + Adam m, v) or x 8 in fp32 (Adam m, v), divided
  by dp x cp with the distributed optimizer; with Muon (optim.name=muon) the layers'
  parameters (matrices; their norms and biases, a few per mille, counted with them) hold x 8
  in bf16 (fp32 master + momentum) or x 4 in fp32 (momentum), the embedding, output layer and
  final norm Adam's bytes; with Muon's layer-wise distributed optimizer
  (optim.distributed_optimizer=true) every part divided by dp x cp (experts by dp x cp / ep),
  an even share of the whole parameters dealt to each rank;
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
  12 x min(c, t) x padded vocab / tp bytes (about three fp32 chunk buffers), plus for a
  trained fp32 output weight the head's fp32 weight-gradient buffer, padded vocab / tp x h x 4
  (bf16: the gradient goes straight into DDP's fp32 main_grad; LoRA: frozen); unchunked
  t x padded vocab / tp x (a + 12) (bf16/fp32 logits, the fp32 copy, the masked copy and its
  gradient in the vocab-parallel cross-entropy);
- runtime: RUNTIME_OVERHEAD_GIB for the CUDA context, NCCL buffers and allocator slack;
- LoRA (model.lora.rank > 0): frozen base, trained adapters (models.estimate.lora_memory);
- a vision tower (models.estimate.vision) on the first stage, whole on every TP rank: its
  weights; trained (model.vision.freeze=false) also its grads, optimizer state and the
  activations of `image_tokens` image tokens per micro-batch (`vision` = (trained,
  image_tokens)).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.estimate.counting import embedding_output_parameters, stage_parameters
from models.estimate.vision import tower_activation_bytes, tower_parameters
from models.estimate.lora_memory import adapter_activation_bytes, with_adapters
from models.estimate.memory import logits_bytes, mixer_bytes
from models.families.registry import family_of, moe_family

GIB = 2 ** 30
RUNTIME_OVERHEAD_GIB = 4.0


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
                    micro_batches: int, recompute: tuple, lora=None,
                    vision: tuple[bool, int] = (False, 0), muon: bool = False) -> MemoryEstimate:
    """Per-GPU peak estimate (formulas in the module docstring) for `layout`
    (a parallel.layout.ParallelLayout, its `sequence_parallel` resolved) and `micro_batches`
    per DP rank per step. `train`: any object with seq_length, micro_batch_size,
    max_tokens_per_micro_batch and loss_chunk_tokens (the train.* keys); `recompute`:
    (granularity, method, num_layers) as resolved by engine.config.model_settings; `lora` (a
    models.lora.adapters.LoraSpec): frozen base + adapters (models.estimate.lora_memory)."""
    tp, pp, cp, vpp = layout.tp, layout.pp, layout.cp, layout.vpp or 1
    granularity, method, group = recompute
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
    logits = logits_bytes(hf, t, tp, a, getattr(train, "loss_chunk_tokens", None), lora is None)
    opt_bytes = optimizer_bytes(bf16, layout, distributed_optimizer)
    expert_opt_bytes = opt_bytes * (layout.ep if distributed_optimizer else 1)
    muon_bytes = (8 if bf16 else 4) if muon else None
    # Muon's layer-wise distributed optimizer: an even share over dp x cp (experts: expert DP)
    muon_share = layout.dp * layout.cp if muon and distributed_optimizer else 1
    adam_only = dict(zip((True, False), embedding_output_parameters(hf, tp, pp)))

    chunk_layers = layers // (pp * vpp)

    def activation_bytes(passes: float) -> float:
        """Kept activations of `passes` layer passes, plus what recomputation rebuilds."""
        if granularity != "full":
            return passes * per_layer
        if method == "uniform":
            return passes / group * layer_input + group * per_layer
        kept = min(group, chunk_layers) / chunk_layers
        return passes * (kept * layer_input + (1 - kept) * per_layer) + per_layer

    def optimizer_state(n_params: int, first: bool) -> float:
        if muon_bytes is None:
            return ((n_params - params.expert_stage) * opt_bytes
                    + params.expert_stage * expert_opt_bytes)
        dense = n_params - adam_only[first] - params.expert_stage
        return (adam_only[first] * opt_bytes + dense * muon_bytes / muon_share
                + params.expert_stage * muon_bytes / max(1, muon_share // layout.ep))

    def stage(n_params: int, act_layers: float, with_logits: bool,
              first: bool = True) -> MemoryEstimate:
        est = MemoryEstimate(weights=n_params * a / GIB, grads=n_params * 4 / GIB,
                             optimizer=optimizer_state(n_params, first) / GIB,
                             activations=(activation_bytes(act_layers)
                                          + 3 * a * t * scores) / GIB,
                             logits=logits / GIB if with_logits else 0.0,
                             notes={"layers_in_flight": act_layers, "tokens_per_rank": t,
                                    "last_stage": with_logits,
                                    "per_layer_bytes": per_layer,
                                    "layer_input_bytes": layer_input})
        return est if lora is None else with_adapters(
            est, n_params, hf, layout, lora, a, opt_bytes, expert_opt_bytes, with_logits)

    first = _with_tower(stage(params.first_stage, first_layers, pp == 1), hf, vision, a,
                        opt_bytes)
    if pp == 1:
        return first
    last = stage(params.last_stage, layers // pp, True, first=False)
    return max(first, last, key=lambda m: m.total)


def _with_tower(est: MemoryEstimate, hf: dict, vision: tuple[bool, int], a: int,
                opt_bytes: float) -> MemoryEstimate:
    """The first stage's estimate with its vision tower (module docstring)."""
    tower = tower_parameters(hf)
    if not tower:
        return est
    trained, image_tokens = vision
    est.weights += tower * a / GIB
    if trained:
        est.grads += tower * 4 / GIB
        est.optimizer += tower * opt_bytes / GIB
        est.activations += tower_activation_bytes(hf, image_tokens, a) / GIB
    est.notes["vision_tower_parameters"] = tower
    return est
