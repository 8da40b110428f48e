"""Weight sync into several rollout engines at several layouts (launched by
tests/test_rl_engines.py on 4 ranks).

    torchrun --nproc_per_node 4 tests/multirank/engine_sync.py MODEL_DIR

For every CASE (training layout, engine owner ranks, target engines) it builds the model from
MODEL_DIR at that layout, gives every owner a recording engine and runs
engine.rl.policy.weight_sync.sync_to_rollout. Each target owner must then hold every HF tensor of
MODEL_DIR exactly once, bitwise equal to the file (the weights are untrained, so the export
is the checkpoint); engines outside `targets` must receive nothing. Every rank also counts the
bytes it received point-to-point (dist.recv is wrapped): a rank that owns no target engine
must receive none (no rank relays another engine's stream). Rank 0 prints one
"RESULT {json}" line per case.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (name, tp, pp, owners, targets or None for all)
CASES = (
    ("pp2_dp2_two_engines", 1, 2, (0, 2), None),      # owners in different stages, same replica
    ("pp2_dp2_engines_on_both_replicas", 1, 2, (0, 1), None),
    ("tp2_dp2_four_engines", 2, 1, (0, 1, 2, 3), None),  # owners that are TP rank 1
    ("tp2_pp2_one_engine_off_rank0", 2, 2, (0, 3), (1,)),  # a restart of engine 1 only
    ("dp4_owner_rank3", 1, 1, (0, 3), None),
)


class RecordingEngine:
    """Collects what update_weights receives (a stand-in rollout engine)."""

    def __init__(self):
        self.tensors: dict = {}
        self.duplicates: list[str] = []

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            if name in self.tensors:
                self.duplicates.append(name)
            self.tensors[name] = tensor.clone()


def main() -> int:
    import torch
    import torch.distributed as dist

    from engine.rl.policy.weight_sync import sync_to_rollout
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    model_dir = sys.argv[1]
    rank, world = init_distributed()
    hf_config = read_config(model_dir)
    reader = SafetensorsReader(model_dir)
    expected = {name: reader.get(name) for name in reader.keys()}
    received = [0]
    real_recv = dist.recv

    def counting_recv(tensor, *args, **kwargs):
        received[0] += tensor.numel() * tensor.element_size()
        return real_recv(tensor, *args, **kwargs)

    dist.recv = counting_recv
    for name, tp, pp, owners, targets in CASES:
        setup_model_parallel(ParallelLayout(world, tp=tp, pp=pp))
        chunks = build_model_chunks(hf_config)
        load_hf_weights(chunks, reader, hf_config)
        mine = owners.index(rank) if rank in owners else None
        engine = RecordingEngine() if mine is not None else None
        received[0] = 0
        stats = sync_to_rollout(chunks, hf_config, engine, 0.01, owners, targets)
        wanted = mine is not None and (targets is None or mine in targets)
        report = {"rank": rank, "engine": mine, "target": wanted,
                  "stats": None if stats is None else stats.total_bytes,
                  "recv_bytes": received[0]}
        if engine is not None:
            got = engine.tensors
            report.update(
                names_ok=set(got) == set(expected) if wanted else not got,
                exact=all(torch.equal(got[n], expected[n]) for n in got if n in expected),
                duplicates=engine.duplicates)
        reports: list = [None] * world
        dist.all_gather_object(reports, report)
        if rank == 0:
            print("RESULT " + json.dumps({"case": name, "reports": reports}), flush=True)
    dist.recv = real_recv
    shutdown()
    return 0


if __name__ == "__main__":
    from engine.cli import exit_process

    exit_process(main())
