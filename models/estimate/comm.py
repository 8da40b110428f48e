"""The communication plan of a layout: bytes each GPU hands to collectives per optimizer step.

Definition ("bytes handed to collectives"): for every collective call a rank makes, the bytes of
the tensor(s) it passes as the call's *input*, summed over the calls of one optimizer step:
all-reduce: the tensor; all-gather: the local input (not the gathered output); reduce-scatter:
the full input buffer; all-to-all: every input chunk summed; point-to-point: the tensors sent
(receives are the sender's bytes and are not counted again). Calls over a group of one rank
are not counted (they move nothing), nor are control scalars (loss sums, token counts, grad
norm, metadata: a few bytes). This is what the engine asks of the library, independent of
the algorithm that moves it: on the wire a ring all-reduce sends about 2 (n-1)/n times its input
per rank, a ring all-gather (n-1) times its input, a reduce-scatter (n-1)/n times it. One
exception is deliberate: on gloo (CPU) the Ulysses CP exchange runs as an all-gather of the
same input (parallel.ulysses), so its *input* bytes equal NCCL's all-to-all on GPUs while gloo
moves cp times more.

Kinds and formulas (per GPU of pipeline stage r; M micro-batches of T tokens per CP rank
(T = tokens per micro-batch / cp), a = bytes per activation element (2 bf16, 4 fp32), h hidden
size, L = layers / pp, s = tp with sequence parallelism else 1, k experts per token):

- dp_grad_reduce: the rank's gradient buffer, once per step: P x g bytes (g = 4 with
  parallel.grad_reduce_in_fp32, else the parameter size); dense parameters over the DP x CP
  group, expert parameters over the expert-DP group (world / (pp x tp x ep)). Reduce-scatter
  with the distributed optimizer, all-reduce without. Overlapped with the backward pass when
  parallel.overlap_grad_reduce is on (same bytes).
- dp_param_all_gather (distributed optimizer): each rank's shard of the updated parameters,
  P / group size x parameter bytes. Overlapped with the next forward when
  parallel.overlap_param_gather is on (same bytes).
- tp_sp (tp > 1), per micro-batch: with sequence parallelism each linear block (attention,
  MLP) hands 3 T h a / tp (all-gathers: forward input, backward input regather for the weight
  gradient, backward output gradient) + 2 T h a (reduce-scatters: forward output, backward
  input gradient); without it 2 T h a (two all-reduces). The embedding (first stage): T h a
  + T h a / s (reduce-scatter and its backward all-gather; without SP one all-reduce); the
  output head (last stage): T h a / s + T h a; the vocab-parallel cross-entropy 3 x T x 4
  (fp32 max, target logit, sum of exponentials). Once per step the gradients of the
  sequence-parallel replicated weights (norms, MoE router) are all-reduced: their count x g.
  A MoE block (tp > 1, expert-TP = TP) hands, with R = T k / tp routed rows per rank (uniform
  routing): forward R h a + R 4 (all-gathers of tokens and probabilities) + tp R h a
  (reduce-scatter of the combine), backward tp R h a + tp R 4 + R h a. Shared experts
  (GLM-4.5, DeepSeek-V3, Qwen3.5) add one MLP block to their MoE layer; the dense first layers
  of those families count as MLP blocks, not as MoE blocks (and move nothing in ep_all_to_all).
  A Gated DeltaNet layer is one linear block (column-parallel in_proj, row-parallel out_proj)
  and all-reduces its replicated output norm's gradient (dv x a) in every backward pass;
  Qwen3.5's sequence-parallel replicated weights are counted per layer kind (attention layers'
  q/k norms, the MoE router and shared-expert gate).
- pp_p2p (pp > 1): per micro-batch, the activations sent forward by each of the vpp model chunks
  that is not the model's last and the gradients sent backward by each chunk that is not its
  first, each T h a / s bytes.
- pp_tied_embedding (pp > 1, tied input/output embeddings): the first and the last stage
  all-reduce the shared matrix's gradient (V_padded / tp x h x g) once per step.
- cp_exchange (cp > 1): per layer and micro-batch, the Ulysses exchanges of q, k, v and the
  attention output forward, and their gradients backward: 2 x T (2 q + 2 kv) a / tp, where
  q = heads x head_dim and kv = kv_heads x head_dim (kv = q when the local KV heads do not
  divide by cp and are repeated first). A Gated DeltaNet layer (Qwen3.5) exchanges its pre-conv
  q, k, v and its beta and decay inputs, and the rule's output back: 2 x T (2 Kd + 2 Vd +
  2 nv) a / tp (models.layers.gated_delta_net.costs; Kd, Vd key and value widths, nv value heads).
- ep_all_to_all (ep > 1), per MoE layer and micro-batch with n = T / s local tokens: the
  token dispatch n k h a and the routing probabilities n k 4 (exact: every local token goes
  out k times), and the combine, which hands back the rows this rank's experts received:
  n k h a in expectation under uniform routing (exact summed over the EP group); forward and
  again backward.

With LoRA (model.lora.rank > 0) the DP kinds move the adapters only (their gradients and, with
the distributed optimizer, their updated shards), the frozen replicated weights and a frozen
tied embedding reduce no gradient; tp_sp adds the adapters' own TP traffic (rank-r products:
with sequence parallelism a column adapter gathers A x, not x; models.estimate.lora_comm)
and the once-per-step TP sum of the gradients of their replicated matrices under sequence
parallelism, and drops what the frozen base does not move (no input re-gather for a weight
gradient, no backward through the embedding).

Full recomputation (train.recompute=full) repeats every layer's forward collectives in the
backward pass (TP, CP, EP kinds). The numbers are derived; tests/test_comm_plan.py measures
them against the engine on CPU (gloo) at DP2, TP2+SP, PP2, CP2, EP2 and LoRA at TP2+SP and
TP2 within 5 %. No number here was measured on GPUs. Not counted: bucket padding of megatron's gradient buffer (at most
63 elements per tensor and lcm(dp, 128) per bucket), control scalars.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.families.registry import moe_family
from models.estimate.counting import padded_vocab_size, stage_parameters
from models.families.base import head_dim
from models.families.registry import family_of
from models.estimate.lora import stage_adapters
from models.estimate.lora_comm import adapter_bytes, frozen_savings, sp_adapter_parameters
from models.layers.mla import costs as mla_costs
from models.layers.gated_delta_net import costs as gdn_costs

KINDS = ("dp_grad_reduce", "dp_param_all_gather", "tp_sp", "pp_p2p", "pp_tied_embedding",
         "cp_exchange", "ep_all_to_all")
GB = 1e9


@dataclass
class CommSetup:
    """What the plan needs besides the model shape and the layout."""

    tokens_per_micro_batch: int          # all CP ranks together (micro_batch_size x length)
    micro_batches: int                   # per DP rank per optimizer step
    act_bytes: int = 2                   # 2 bf16, 4 fp32
    distributed_optimizer: bool = True
    grad_reduce_in_fp32: bool = True
    full_recompute: bool = False
    lora: object = None                  # models.lora.adapters.LoraSpec: only adapters have gradients


@dataclass
class CommPlan:
    """Bytes per GPU per optimizer step by kind: per pipeline stage, and the busiest GPU."""

    stages: list[dict[str, float]]
    groups: dict[str, int] = field(default_factory=dict)

    @property
    def per_gpu(self) -> dict[str, float]:
        """Per kind, the largest value over pipeline stages."""
        return {k: max(s[k] for s in self.stages) for k in KINDS}


def _stage_params(hf: dict, layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds."""
    tp, pp = layout.tp, layout.pp
    sp = stage_parameters(hf, tp, pp, layout.ep)
    embedding = padded_vocab_size(hf["vocab_size"], tp) * hf["hidden_size"] // tp
    if pp == 1 or stage == 0:
        total = sp.first_stage
    elif stage == pp - 1:
        total = sp.last_stage
    else:
        total = sp.first_stage - embedding
    return total - sp.expert_stage, sp.expert_stage


def _sp_replicated(hf: dict, stage: int, layers: int, last: bool) -> int:
    """Sequence-parallel-tagged replicated weights of a stage (norms, q/k norms, router)."""
    h = hf["hidden_size"]
    if gdn_costs.uses_gdn(hf):  # Qwen3.5: per layer kind (models.layers.gated_delta_net.costs)
        span = range(stage * layers, (stage + 1) * layers)
        return sum(gdn_costs.sp_replicated(hf, i) for i in span) + (h if last else 0)
    moe = moe_family(hf)
    per_layer = 2 * h + (2 * head_dim(hf) if family_of(hf).has_qk_norm(hf) else 0)
    if mla_costs.uses_mla(hf):  # MLA: layer norms, latent norms, replicated down projections
        per_layer = mla_costs.sp_replicated(hf)
    if moe is not None:  # the router (and gpt-oss's router bias)
        per_layer += moe.num_experts(hf) * (h + int(moe.expert_biases))
    return layers * per_layer + (h if last else 0)


def _gdn_layers(hf: dict, stage: int, layers: int) -> int:
    """Gated DeltaNet layers among the `layers` of pipeline stage `stage` (0: none)."""
    span = range(stage * layers, (stage + 1) * layers)
    return sum(gdn_costs.is_gdn_layer(hf, i) for i in span)


def _moe_layers(hf: dict, stage: int, layers: int) -> int:
    """Decoder layers with experts among the `layers` of pipeline stage `stage` (0 for a dense
    model; families with dense first layers count them out)."""
    moe = moe_family(hf)
    if moe is None:
        return 0
    return sum(moe.is_moe_layer(hf, i) for i in range(stage * layers, (stage + 1) * layers))


def _tp_bytes(hf: dict, layout, setup: CommSetup, stage: int, layers: int) -> float:
    """tp_sp bytes of one micro-batch (module docstring), layer forwards counted once."""
    tp, a, t, h = layout.tp, setup.act_bytes, setup.tokens_per_micro_batch / layout.cp, \
        hf["hidden_size"]
    sp = layout.sequence_parallel
    block = (3 * t * h * a / tp + 2 * t * h * a) if sp else 2 * t * h * a
    block_fwd = (t * h * a / tp + t * h * a) if sp else t * h * a
    moe = moe_family(hf)
    sparse = _moe_layers(hf, stage, layers)
    mlp = mlp_fwd = 0.0
    if sparse:
        r = t * moe.experts_per_token(hf) / tp
        mlp = sparse * (2 * (r * h * a + tp * r * h * a) + r * 4 + tp * r * 4)
        mlp_fwd = sparse * (r * h * a + tp * r * h * a + r * 4)
        if moe.shared_expert_width(hf):  # a TP-sharded MLP block beside the experts
            mlp, mlp_fwd = mlp + sparse * block, mlp_fwd + sparse * block_fwd
    mlp, mlp_fwd = mlp + (layers - sparse) * block, mlp_fwd + (layers - sparse) * block_fwd
    attention, attention_fwd = block, block_fwd
    if mla_costs.uses_mla(hf):  # MLA: latents gathered, not the hidden state
        attention, attention_fwd = (x * t * a for x in mla_costs.tp_elements(hf, tp, sp))
    total = layers * attention + mlp + (layers * attention_fwd + mlp_fwd
                                        if setup.full_recompute else 0)
    # GDN: the replicated output norm's gradient, all-reduced in every backward pass
    if gdn_costs.uses_gdn(hf):
        total += _gdn_layers(hf, stage, layers) * gdn_costs.gdn_norm_width(hf) * a
    if stage == 0:
        total += t * h * a + (t * h * a / tp if sp else 0)
    if stage == layout.pp - 1:
        total += (t * h * a / tp if sp else 0) + t * h * a + 3 * t * 4
    return total


def _cp_bytes(hf: dict, layout, setup: CommSetup, stage: int, layers: int) -> float:
    tp, cp, a = layout.tp, layout.cp, setup.act_bytes
    t = setup.tokens_per_micro_batch / cp
    heads = hf["num_attention_heads"] // tp
    kv_heads = max((hf.get("num_key_value_heads") or hf["num_attention_heads"]) // tp, 1)
    if kv_heads % cp:
        kv_heads = heads
    hd = head_dim(hf)
    fwd = t * (2 * heads + 2 * kv_heads) * hd * a
    if mla_costs.uses_mla(hf):  # MLA: expanded query, key, value and output
        fwd = t * mla_costs.exchange_elements(hf, tp) * a
    gdn = _gdn_layers(hf, stage, layers)  # GDN: q, k, v, beta, decay in; the output back
    total = (layers - gdn) * fwd + (gdn and gdn * t * gdn_costs.gdn_exchange_elements(hf, tp) * a)
    return total * (3 if setup.full_recompute else 2)


def _ep_bytes(hf: dict, layout, setup: CommSetup, stage: int, layers: int) -> float:
    moe = moe_family(hf)
    t = setup.tokens_per_micro_batch / layout.cp
    n = t / layout.tp if layout.sequence_parallel else t
    rows = n * moe.experts_per_token(hf)
    fwd = 2 * rows * hf["hidden_size"] * setup.act_bytes + rows * 4
    return _moe_layers(hf, stage, layers) * fwd * (3 if setup.full_recompute else 2)


def comm_plan(hf: dict, layout, setup: CommSetup) -> CommPlan:
    """The plan of `layout` (parallel.layout.ParallelLayout, sequence_parallel resolved) for
    the HF config `hf`: formulas of the module docstring."""
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    vpp = layout.vpp or 1
    dpcp = layout.dp * cp
    edp = layout.world_size // (pp * tp * ep)
    a, m = setup.act_bytes, setup.micro_batches
    g = 4 if setup.grad_reduce_in_fp32 else a
    layers = hf["num_hidden_layers"] // pp
    h = hf["hidden_size"]
    t = setup.tokens_per_micro_batch / cp
    tied = bool(hf.get("tie_word_embeddings", False))
    stages = []
    for r in range(pp):
        dense, expert = _stage_params(hf, layout, r)
        if setup.lora is not None:  # LoRA (models.estimate.lora): the adapters alone train
            both, expert = stage_adapters(hf, setup.lora.targets, setup.lora, tp, pp, ep, r)
            dense = both - expert
        row = dict.fromkeys(KINDS, 0.0)
        row["dp_grad_reduce"] = (dense * g if dpcp > 1 else 0) + (expert * g if edp > 1 else 0)
        if setup.distributed_optimizer:
            row["dp_param_all_gather"] = ((dense * a / dpcp if dpcp > 1 else 0)
                                          + (expert * a / edp if edp > 1 else 0))
        if tp > 1:
            row["tp_sp"] = m * _tp_bytes(hf, layout, setup, r, layers)
            if layout.sequence_parallel and setup.lora is None:  # LoRA: frozen norms
                row["tp_sp"] += _sp_replicated(hf, r, layers, r == pp - 1) * g
            if setup.lora is not None:  # the adapters' traffic, the frozen base's savings
                row["tp_sp"] += m * (adapter_bytes(hf, setup.lora, layout, t, a, r, layers,
                                                   setup.full_recompute)
                                     - frozen_savings(hf, layout, t, a, r, layers)) \
                    + sp_adapter_parameters(hf, setup.lora, layout, r, layers) * g
        if pp > 1:
            sends = 2 * vpp - (r == pp - 1) - (r == 0)
            row["pp_p2p"] = m * sends * t * h * a / (tp if layout.sequence_parallel else 1)
            if tied and r in (0, pp - 1) and setup.lora is None:
                row["pp_tied_embedding"] = padded_vocab_size(hf["vocab_size"], tp) * h // tp * g
        if cp > 1:
            row["cp_exchange"] = m * _cp_bytes(hf, layout, setup, r, layers)
        if ep > 1 and moe_family(hf) is not None:
            row["ep_all_to_all"] = m * _ep_bytes(hf, layout, setup, r, layers)
        stages.append(row)
    return CommPlan(stages, {"dp_x_cp": dpcp, "expert_dp": edp, "tp": tp, "pp": pp, "cp": cp,
                             "ep": ep})
