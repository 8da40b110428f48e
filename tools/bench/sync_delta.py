"""rollout.sync_delta measured: bytes and sync time per version, deltas against whole tensors.

`python -m tools.bench.sync_delta [--steps 20] [--lr 1e-6]` (one run, two processes on this
host): the 127M-parameter Qwen3-shaped benchmark model of tools/bench/sync.py (MODEL) is built
with transformers and trained by rank 0 with torch.optim.AdamW (fp32 master weights, betas
0.9/0.999, no weight decay) for `steps` steps at `lr` on random-token batches (4 x 128 tokens,
next-token loss); after each step the weights cast to bf16 (the rollout dtype) are version v.
Each version goes to rank 1 twice, over gloo on the loopback interface, through the engine's
own sender and receiver (engine.rl.disaggregated.weight_send.push_weights with its export
replaced by the version's HF-named bf16 tensors, inbox.receive_version): once as whole tensors
(rollout.sync_delta=false) and once with deltas. Rank 1 checks that the two receptions are
bitwise equal. Timed per version, from a barrier to the end of rank 1's receive: the whole
sync (sender encode, transfer, receiver rebuild), and apart the sender's push.
Version 0 (the initial weights) goes whole both ways and is not reported.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tools.bench.sync import MODEL

BATCH, SEQ = 4, 128


def _trajectory(model_dir: str, steps: int, lr: float):
    """Yield (version, [(HF name, bf16 tensor)]) for versions 0..steps."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    tied = model.config.tie_word_embeddings

    def snapshot():
        return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()
                if not (tied and n == "lm_head.weight")]
    yield 0, snapshot()
    for v in range(1, steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield v, snapshot()


def _encodings(previous, tensors) -> dict:
    """Bytes of the version if every tensor went as int32 positions, as a bitmask, or by the
    size rule (delta.choose), against the previous version."""
    from engine.rl.disaggregated.delta import INDEX, MASK, bits, choose, payload_bytes

    if previous is None:
        return {}
    out = {"index_bytes": 0, "mask_bytes": 0, "rule_bytes": 0, "index_tensors": 0,
           "mask_tensors": 0, "full_tensors": 0}
    for (_, old), (_, new) in zip(previous, tensors):
        n, k, e = new.numel(), int((bits(new) != bits(old)).sum()), new.element_size()
        kind = choose(n, k, e)
        out["index_bytes"] += payload_bytes(INDEX, n, k, e)
        out["mask_bytes"] += payload_bytes(MASK, n, k, e)
        out["rule_bytes"] += payload_bytes(kind, n, k, e)
        out[f"{kind}_tensors"] += 1
    return out


def _worker(rank: int, store_path: str, model_dir: str, steps: int, lr: float, out: str):
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from engine.rl.disaggregated import inbox, weight_send
    from engine.rl.disaggregated.delta import ReceiverBases, SenderBases, bits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    group = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - the gloo group itself
    split = SimpleNamespace(weights=group, bridge=group, timeout_s=1800.0,
                            describe_peer=lambda r: f"rank {r}")
    plan = weight_send.TransferPlan(sends={0: [1]}, sources={1: [0]}, first_stage={0})
    rows = []
    if rank == 0:
        senders = {"full": SenderBases(False), "delta": SenderBases(True)}
        previous = None
        for v, tensors in _trajectory(model_dir, steps, lr):
            for mode in ("full", "delta"):
                weight_send.export_stage_weights = lambda *a, _t=tensors: iter(_t)
                dist.barrier()
                t0 = time.perf_counter()
                _, wire = weight_send.push_weights(split, [], {}, 512, plan, v, senders[mode])
                rows.append({"version": v, "mode": mode, "push_s": time.perf_counter() - t0,
                             "bytes": wire.bytes, "changed": wire.changed,
                             "elements": wire.elements})
            rows[-1].update(_encodings(previous, tensors))
            previous = tensors
    else:
        receivers = {"full": ReceiverBases(), "delta": ReceiverBases()}
        for v in range(steps + 1):
            got = {}
            for mode in ("full", "delta"):
                dist.barrier()
                t0 = time.perf_counter()
                got[mode] = inbox.receive_version(split, [0], receivers[mode])
                rows.append({"version": v, "mode": mode, "sync_s": time.perf_counter() - t0})
            pairs = zip([x for b in got["full"].buckets for x in b],
                        [x for b in got["delta"].buckets for x in b])
            assert all(a[0] == b[0] and torch.equal(bits(a[1]), bits(b[1])) for a, b in pairs), v
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from tools.tiny_models import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_delta_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **MODEL)
        out = os.path.join(tmp, "rows")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), model_dir, args.steps, args.lr,
                                out), nprocs=2)
        send = json.load(open(f"{out}.0"))
        recv = {(r["version"], r["mode"]): r["sync_s"] for r in json.load(open(f"{out}.1"))}
    print("| version | changed % | full MB | delta MB | delta/full | int32 positions only MB | "
          "bitmask only MB | tensors index/mask/full | full sync s | delta sync s | "
          "delta push s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["version"], r["mode"]): r for r in send}
    for v in range(1, args.steps + 1):
        f, d = by[(v, "full")], by[(v, "delta")]
        print(f"| {v} | {100 * d['changed'] / d['elements']:.2f} | {f['bytes'] / 1e6:.1f} | "
              f"{d['bytes'] / 1e6:.1f} | {d['bytes'] / f['bytes']:.3f} | "
              f"{d['index_bytes'] / 1e6:.1f} | {d['mask_bytes'] / 1e6:.1f} | "
              f"{d['index_tensors']}/{d['mask_tensors']}/{d['full_tensors']} | "
              f"{recv[(v, 'full')]:.3f} | {recv[(v, 'delta')]:.3f} | {d['push_s']:.3f} |")
    print(json.dumps({"rows": send, "sync_s": {f"{v}:{m}": s for (v, m), s in recv.items()}}))


if __name__ == "__main__":
    main()
