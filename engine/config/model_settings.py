"""Megatron model settings chosen by the configuration: TP sequence parallelism and activation
recomputation.

- `parallel.sequence_parallel` (null: on whenever parallel.tp > 1, as megatron recommends;
  true needs tp > 1): activations outside attention and MLP (norms, residuals, dropout) are
  split along the sequence over the TP group instead of replicated. Megatron all-gathers the
  sequence before the column-parallel linears and reduce-scatters after the row-parallel
  ones; the norm weights' gradients are summed over TP (models.layers.norms.local). The loss and gradient
  do not change; micro-batches are padded so each TP rank gets an equal slice
  (engine.training.rank_batch: a multiple of tp, of 2 x cp x tp with context parallelism).
- `train.recompute`: `none`; `selective` (megatron's "core_attn": the attention core is
  recomputed in the backward pass instead of keeping its internals); `full` (whole transformer
  layers are recomputed, only their inputs are kept) with `train.recompute_method` `uniform`
  (groups of `train.recompute_num_layers` consecutive layers, one kept input per group) or
  `block` (the first `recompute_num_layers` layers of each pipeline chunk recomputed, the rest
  keep everything). Recomputation replays the forward with the same RNG states (megatron's
  checkpoint), so the loss and gradient do not change either.
- `train.loss_chunk_tokens` (SFT and RL; default engine.training.loss_head.
  DEFAULT_LOSS_CHUNK_TOKENS): the output projection and the vocab-parallel log-softmax/entropy
  run chunk by chunk over this many tokens (engine.training.loss_head), so no [tokens, vocab/tp]
  float32 logits of a whole micro-batch are held; 0 or null: megatron's unchunked logits. Same
  loss and gradient within float32 rounding.

`megatron_overrides` maps these keys to TransformerConfig fields; `recompute_problems`,
`recompute_layer_problems` and `loss_chunk_problems` check them before any process group
exists (every problem names its key and the valid values; `parallel.sequence_parallel=true`
with tp = 1 is refused by parallel.layout).
"""
from __future__ import annotations

RECOMPUTE_CHOICES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
DEFAULT_RECOMPUTE_METHOD = "uniform"
DEFAULT_RECOMPUTE_NUM_LAYERS = 1


def sequence_parallel_on(parallel_cfg) -> bool:
    """`parallel.sequence_parallel` resolved: null means on exactly when tp > 1."""
    sp = parallel_cfg.sequence_parallel
    return parallel_cfg.tp > 1 if sp is None else bool(sp)


def recompute_settings(train_cfg) -> tuple[str, str | None, int | None]:
    """(granularity, method, num_layers) of `train.recompute*`; method and num_layers are
    None unless the granularity is full (then their defaults fill nulls)."""
    recompute = train_cfg.recompute
    if recompute != "full":
        return recompute, None, None
    method = train_cfg.recompute_method or DEFAULT_RECOMPUTE_METHOD
    layers = train_cfg.recompute_num_layers
    return recompute, method, DEFAULT_RECOMPUTE_NUM_LAYERS if layers is None else layers


def recompute_problems(train_cfg) -> list[str]:
    """Every invalid value among train.recompute, train.recompute_method and
    train.recompute_num_layers (no model needed)."""
    p: list[str] = []
    recompute = train_cfg.recompute
    if recompute not in RECOMPUTE_CHOICES:
        return [f"train.recompute={recompute!r} is not valid; choose one of "
                f"{', '.join(RECOMPUTE_CHOICES)}"]
    method, layers = train_cfg.recompute_method, train_cfg.recompute_num_layers
    if recompute != "full":
        for key, value in (("recompute_method", method), ("recompute_num_layers", layers)):
            if value is not None:
                p.append(f"train.{key}={value!r} applies only to train.recompute=full (got "
                         f"train.recompute={recompute}); remove it or use full")
        return p
    if method is not None and method not in RECOMPUTE_METHODS:
        p.append(f"train.recompute_method={method!r} is not valid; choose one of "
                 f"{', '.join(RECOMPUTE_METHODS)} (or null: {DEFAULT_RECOMPUTE_METHOD})")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool)
                               or layers < 1):
        p.append(f"train.recompute_num_layers={layers!r} must be null or an integer >= 1")
    return p


def recompute_layer_problems(parallel_cfg, train_cfg, num_layers: int) -> list[str]:
    """train.recompute_num_layers against the layers of one pipeline chunk (the model's
    num_layers / (pp x vpp)): uniform groups must tile a chunk, block cannot exceed it.
    Empty when the values themselves or the pp x vpp split are invalid (reported elsewhere)."""
    if recompute_problems(train_cfg) or train_cfg.recompute != "full":
        return []
    chunks = parallel_cfg.pp * (parallel_cfg.vpp or 1)
    if not isinstance(chunks, int) or chunks < 1 or num_layers % chunks:
        return []
    _, method, layers = recompute_settings(train_cfg)
    per_chunk = num_layers // chunks
    if method == "uniform" and per_chunk % layers:
        valid = [d for d in range(1, per_chunk + 1) if per_chunk % d == 0]
        return [f"train.recompute_num_layers={layers} must divide the {per_chunk} layers of "
                f"each pipeline chunk (num_hidden_layers={num_layers} / (parallel.pp x "
                f"parallel.vpp = {chunks})) with train.recompute_method=uniform; valid: "
                f"{valid}"]
    if method == "block" and layers > per_chunk:
        return [f"train.recompute_num_layers={layers} exceeds the {per_chunk} layers of each "
                f"pipeline chunk (num_hidden_layers={num_layers} / (parallel.pp x "
                f"parallel.vpp = {chunks})) with train.recompute_method=block; valid: "
                f"1..{per_chunk}"]
    return []


def megatron_overrides(parallel_cfg, train_cfg=None) -> dict:
    """TransformerConfig fields for these keys (`train_cfg` None: no recomputation)."""
    out: dict = {"sequence_parallel": sequence_parallel_on(parallel_cfg)}
    if train_cfg is None:
        return out
    granularity, method, layers = recompute_settings(train_cfg)
    if granularity != "none":
        out["recompute_granularity"] = granularity
    if granularity == "full":
        out.update(recompute_method=method, recompute_num_layers=layers)
    return out


def describe(config) -> str:
    """One line on what a built model's TransformerConfig runs with, e.g. "sequence
    parallelism on, recompute full (uniform, 1 layer(s))"."""
    sp = "on" if config.sequence_parallel else "off"
    granularity = config.recompute_granularity or "none"
    if granularity == "full":
        granularity += f" ({config.recompute_method}, {config.recompute_num_layers} layer(s))"
    elif granularity == "selective":
        granularity += f" ({', '.join(config.recompute_modules)})"
    return f"sequence parallelism {sp}, recompute {granularity}"


def loss_chunk_problems(train_cfg) -> list[str]:
    """train.loss_chunk_tokens: null or an integer >= 0 (SFT and RL)."""
    value = train_cfg.loss_chunk_tokens
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return []
    return [f"train.loss_chunk_tokens={value!r} must be null or an integer >= 0 (tokens per "
            "chunk of the loss head; 0 or null: unchunked logits)"]
