"""Host syncs in the training step's forward/backward and grad norm, counted on the CPU.

  python tests/multirank/step_syncs_check.py DENSE_HF_DIR MOE_HF_DIR   (1 process)

A CUDA host sync is an operation that makes the host read a device value (or wait for the
device). The CPU host has no device, so this counts the calls that would be one: every
torch function seen by a TorchFunctionMode whose name is in SYNC_OPS (a value read to the host,
or an output whose size depends on the values), every tensor element of a list given to
`torch.tensor` (each is read to the host), and every tensor megatron's MoE dispatcher hands
to `maybe_move_tensor_to_cpu` (its device-to-host copy, a no-op on a CPU tensor). Each is
recorded with the first caller outside torch ("file:line").

For the dense (Qwen3) and the MoE (Qwen3-MoE, 8 experts top-2, grouped experts) tiny model, one
fp32 forward and backward of a packed micro-batch built by the engine (three sequences of 7, 12
and 5 tokens in one row), in two modes:
  engine:   as the engine builds it (host boundaries, gather RoPE, argsort permutation,
            sync-free dispatcher at tp x ep = 1);
  megatron: the negative control, megatron's code paths restored (a plain PackedSeqParams,
            megatron's thd and bshd RoPE, masked_select permutation, the dispatcher's D2H copy/sync and
            chunk sort).
One RESULT line each: {"model", "mode", "syncs", "sites": {site: count}, "cos", "logits",
"grads"} ("cos": torch.cos calls, RoPE's tables: once per micro-batch in engine mode,
models.layers.attention.rope_tables; per layer, for queries and keys, per sequence in
megatron's)
("logits"/"grads": max |engine - megatron|, the same forward/backward, must be 0: fp32
bitwise). Then the grad norm of the MoE model's gradients with megatron's get_grad_norm_fp32 and
the clip scale (engine.training.grad_norm installed, then megatron's local stand-ins):
  {"case": "grad_norm", "mode", "syncs", "sites", "norm", "tensors"}
  {"case": "clip", "mode", "syncs", "sites", "grads"}
Last, one whole SFT optimizer step of the MoE model through TrainEngine (`whole_step`):
  {"case": "step", "syncs", "sites", "loss", "micro_batches"}
"""
from __future__ import annotations

import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

SYNC_OPS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
            "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
LENGTHS = (7, 12, 5)


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" in path or path.endswith("step_syncs_check.py"):
            continue
        marker = "/site-packages/"
        short = path.split(marker)[-1] if marker in path else str(Path(path).relative_to(ROOT))
        return f"{short}:{frame.lineno}"
    return "?"


def _tensors_in(values) -> int:
    if torch.is_tensor(values):
        return 1
    if isinstance(values, (list, tuple)):
        return sum(_tensors_in(v) for v in values)
    return 0


class SyncCounter(TorchFunctionMode):
    """Counts SYNC_OPS calls (and `count_copy` calls) by caller site while active, and the
    `torch.cos` calls (RoPE's cos tables) in `cos`."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()
        self.cos = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.cos += name == "cos"
        if name in SYNC_OPS:
            self.sites[f"{name} @ {_site()}"] += 1
        elif name == "tensor" and args and isinstance(args[0], (list, tuple)):
            # torch.tensor([device scalars]) reads each one to the host
            reads = _tensors_in(args[0])
            if reads:
                self.sites[f"tensor(list of tensors) @ {_site()}"] += reads
        return func(*args, **(kwargs or {}))

    def count_copy(self, tensor) -> None:
        if torch.is_tensor(tensor):
            self.sites[f"maybe_move_tensor_to_cpu @ {_site()}"] += 1


def _counted(fn, counter: SyncCounter):
    def wrapper(tensor, *args, **kwargs):
        counter.count_copy(tensor)
        return fn(tensor, *args, **kwargs)
    return wrapper


def _set_mode(mode: str, chunk) -> None:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import token_dispatcher

    from models.layers.attention import packed_rope, rope_tables
    from models.layers.experts import sync_free

    engine = mode == "engine"
    rope_utils._apply_rotary_pos_emb_thd = (packed_rope.apply_thd if engine
                                            else packed_rope.megatron_thd())
    rope_utils._apply_rotary_pos_emb_bshd = (rope_tables.apply_bshd if engine
                                             else rope_tables.megatron_bshd())
    rope_tables.clear()
    own = engine and not sync_free.MEGATRON_PERMUTE_IS_SYNC_FREE  # >= 0.17 is megatron's own
    token_dispatcher.permute = sync_free.permute if own else sync_free._MEGATRON_PERMUTE
    dispatchers = [getattr(m, "token_dispatcher", None) for m in chunk.modules()]
    for d in dispatchers:
        if isinstance(d, sync_free.SyncFreeAlltoAllDispatcher):
            d.local_only = engine and d.tp_size * d.ep_size == 1


def _micro_batch(vocab: int, mode: str):
    from megatron.core.packed_seq_params import PackedSeqParams

    from engine.training.micro_batches import SequenceData, build_packed

    gen = torch.Generator().manual_seed(7)
    seqs = []
    for n in LENGTHS:
        toks = torch.randint(1, vocab, (n,), generator=gen).tolist()
        seqs.append(SequenceData(toks, toks[1:] + [0], [1] * n, 1.0))
    mb = build_packed(seqs, list(range(len(seqs))), 1, None, 1, 0)
    if mode == "megatron":   # what the engine built before: boundaries only as tensors
        p = mb.packed_seq_params
        mb.packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_kv=p.cu_seqlens_kv,
            cu_seqlens_q_padded=p.cu_seqlens_q_padded,
            cu_seqlens_kv_padded=p.cu_seqlens_kv_padded, max_seqlen_q=p.max_seqlen_q,
            max_seqlen_kv=p.max_seqlen_kv)
    return mb


def forward_backward(chunk, cfg: dict, mode: str):
    """(sync sites, logits, {name: grad}) of one packed forward/backward in `mode`."""
    from megatron.core.transformer.moe import token_dispatcher

    _set_mode(mode, chunk)
    chunk.zero_grad(set_to_none=True)
    mb = _micro_batch(cfg["vocab_size"], mode)
    weights = torch.cos(torch.arange(mb.tokens.numel() * 1.0)).view(1, -1, 1)
    counter = SyncCounter()
    move = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _counted(move, counter)
    try:
        with counter:
            logits = chunk(mb.tokens, mb.position_ids, None,
                           packed_seq_params=mb.packed_seq_params)
            (logits * weights).sum().backward()
    finally:
        token_dispatcher.maybe_move_tensor_to_cpu = move
    grads = {k: p.grad.clone() for k, p in chunk.named_parameters() if p.grad is not None}
    return counter, logits.detach(), grads


def model_cases(name: str, hf_dir: str) -> dict:
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader, read_config

    cfg = read_config(hf_dir)
    (chunk,) = build_model_chunks(cfg)
    load_hf_weights([chunk], SafetensorsReader(hf_dir), cfg)
    runs = {mode: forward_backward(chunk, cfg, mode) for mode in ("engine", "megatron")}
    _set_mode("engine", chunk)
    _, ref_logits, ref_grads = runs["megatron"]
    for mode, (counter, logits, grads) in runs.items():
        diff = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        sites = counter.sites
        print("RESULT " + json.dumps({
            "model": name, "mode": mode, "syncs": sum(sites.values()), "sites": dict(sites),
            "cos": counter.cos,
            "logits": (logits - ref_logits).abs().max().item(),
            "grads": diff if set(grads) == set(ref_grads) else float("inf")}), flush=True)
    return runs["engine"][2]


def norm_cases(grads: dict) -> None:
    from megatron.core.optimizer import clip_grads

    from engine.training import grad_norm

    tensors = list(grads.values())
    results = {}
    for mode in ("engine", "megatron"):
        if mode == "engine":
            grad_norm.install()
        else:
            clip_grads.l2_norm_impl = grad_norm._MEGATRON_L2_NORM
            clip_grads.multi_tensor_scale_impl = grad_norm._MEGATRON_SCALE
        copies = [t.clone() for t in tensors]
        with SyncCounter() as norm_counter:
            norm = clip_grads.get_grad_norm_fp32(copies)
        params = []
        for g in copies:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g
            params.append(p)
        with SyncCounter() as clip_counter:
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=norm / 3, total_norm=norm)
        results[mode] = (norm, copies)
        print("RESULT " + json.dumps({
            "case": "grad_norm", "mode": mode, "syncs": sum(norm_counter.sites.values()),
            "sites": dict(norm_counter.sites), "norm": norm, "tensors": len(tensors)}),
            flush=True)
        print("RESULT " + json.dumps({
            "case": "clip", "mode": mode, "syncs": sum(clip_counter.sites.values()),
            "sites": dict(clip_counter.sites)}), flush=True)
    same = all(torch.equal(a, b) for a, b in zip(results["engine"][1], results["megatron"][1]))
    print("RESULT " + json.dumps({"case": "clip_equal", "equal": same,
                                  "norm_equal": results["engine"][0] == results["megatron"][0]}),
          flush=True)
    grad_norm.install()


def whole_step(hf_dir: str) -> None:
    """One SFT optimizer step of the MoE model through TrainEngine (packing into 2 micro-batches,
    fp32, distributed optimizer, the engine's loss head): every sync site of the step, counted
    from the batch on the host to the updated weights.
    {"case": "step", "syncs", "sites", "loss", "micro_batches"}"""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import token_dispatcher

    from engine.sft.training import SFT_REPORT_KEYS, sft_loss_fn
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.micro_batches import SequenceData
    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config

    cfg = read_config(hf_dir)
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.01,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    batching = BatchSettings(max_tokens_per_micro_batch=13, packing=True)   # 2 micro-batches
    engine = TrainEngine.build(cfg, optim, torch.float32, 2, batching, weights_dir=hf_dir)
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for n in LENGTHS:
        toks = torch.randint(1, cfg["vocab_size"], (n,), generator=gen).tolist()
        seqs.append(SequenceData(toks, toks[1:] + [0], [1] * n))
    normalizer = GlobalLossNormalizer("token-mean", 32, True, group=ps.get_data_parallel_group())
    counter = SyncCounter()
    move = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _counted(move, counter)
    try:
        with counter:
            out = engine.train_batch(seqs, normalizer, sft_loss_fn(engine.vocab_size),
                                     SFT_REPORT_KEYS)
    finally:
        token_dispatcher.maybe_move_tensor_to_cpu = move
    print("RESULT " + json.dumps({"case": "step", "syncs": sum(counter.sites.values()),
                                  "sites": dict(counter.sites), "loss": out["loss"],
                                  "micro_batches": out["train/micro_batches"]}), flush=True)
    engine.release()


def main() -> int:
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    _, world = init_distributed()
    setup_model_parallel(ParallelLayout(world))
    model_cases("dense", sys.argv[1])
    norm_cases(model_cases("moe", sys.argv[2]))
    whole_step(sys.argv[2])
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
