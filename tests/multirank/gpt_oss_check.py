"""gpt-oss layouts against the single-process reference (launched by tests/test_gpt_oss.py on
the rank pool):

    gpt_oss_check.py MODEL_DIR REF_FILE SPEC...

SPEC as tests/multirank/sft_invariance.py's ("tp,pp,vpp,cp,mbs[,flags]": sp, packing, ep=E),
trained with its run_layout (3 Adam steps, token-mean, the same synthetic batches, Adam eps
1e-3) from the tiny gpt-oss model's HF weights. At world 1 the first spec is the reference
(saved to REF_FILE); every other spec prints one "RESULT {json}" line with the relative
differences of loss, grad norm and parameters. Flag `control=` breaks the attention on
purpose (a negative control, which must NOT match):
  control=window    packed sequences: the sliding layers attend over the whole packed row,
                    so a window crosses into the previous sequence (full layers stay exact);
  control=sinkslice CP: every CP rank uses the sinks of heads 0..h/cp-1 for the heads the
                    Ulysses exchange gave it (the sink slice not following the exchange).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ADAM_EPS = 1e-3
MODE = "token-mean"


@contextlib.contextmanager
def broken(control: str | None):
    """The attention broken as `control` says (module docstring), restored afterwards."""
    from models.layers.attention import core as core_attention
    from parallel import ulysses

    original_packed, original_attention = (core_attention.packed_causal_attention,
                                           ulysses._attention)

    def leaky_packed(q, k, v, cu_seqlens, scale, attend=None):
        if attend is None or getattr(attend, "window_left", None) is None:
            return original_packed(q, k, v, cu_seqlens, scale, attend)
        whole = [0, q.shape[0]]   # the boundaries come as host ints (parallel.packed_seqs)
        return original_packed(q, k, v, whole, scale, attend)

    def wrong_slice(qkv, scale, attend, first_head):
        return original_attention(qkv, scale, attend, 0)

    if control == "window":
        core_attention.packed_causal_attention = leaky_packed
    elif control == "sinkslice":
        ulysses._attention = wrong_slice
    elif control is not None:
        raise ValueError(f"unknown control {control!r}")
    try:
        yield
    finally:
        core_attention.packed_causal_attention = original_packed
        ulysses._attention = original_attention


def main():
    import torch
    import torch.distributed as dist

    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown
    from tests.multirank import sft_invariance as inv

    model_dir, ref_file, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, world = init_distributed()
    inv.ADAM_EPS = ADAM_EPS
    hf_config = read_config(model_dir)
    batches = inv.synthetic_batches(hf_config["vocab_size"])
    ref = torch.load(ref_file) if os.path.exists(ref_file) else None
    for spec in specs:
        flags = spec.split(",")[5].split("+") if spec.count(",") >= 5 else []
        control = next((f.split("=")[1] for f in flags if f.startswith("control=")), None)
        layout_kw, train = inv.parse_spec(spec)
        setup_model_parallel(ParallelLayout(world, **layout_kw))
        with broken(control):
            losses, norms, params = inv.run_layout(model_dir, hf_config, train, MODE, batches,
                                                   inv.spec_options(spec)["overrides"])
        if ref is None:
            ref = {"loss": losses, "grad_norm": norms, "params": params}
            torch.save(ref, ref_file)
            out = {"spec": spec, "reference": True, "loss": losses}
        else:
            rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
            pdiff = torch.tensor([inv.param_diff(params, ref["params"])], dtype=torch.float64)
            dist.all_reduce(pdiff, op=dist.ReduceOp.MAX)
            out = {"spec": spec, "control": control, "loss": losses,
                   "loss_rel": rel(losses, ref["loss"]),
                   "grad_norm_rel": rel(norms, ref["grad_norm"]), "param_rel": float(pdiff)}
        if rank == 0:
            print("RESULT " + json.dumps(out), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
