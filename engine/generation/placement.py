"""Where the rollout engines of a job live: `rollout.num_engines` engines, each owned by one
rank and using `rollout.gpus_per_engine` devices of that rank's node (docs/rl.md).

Ranks are numbered as torchrun numbers them: node k holds the contiguous ranks
[k * L, (k + 1) * L), L = processes per node (LOCAL_WORLD_SIZE). With E engines on N nodes:
- E <= N (N divisible by E): engine e sits on node e * N / E, owned by its local rank 0;
- E > N (E divisible by N): E / N engines per node, engine e's slot j = e mod (E / N) owned by
  local rank j * gpus_per_engine; the slots must fit: E / N * gpus_per_engine <= L.
Engine 0 is always owned by global rank 0 (the rank that drives the rollout). Defaults: one
engine per node, gpus_per_engine = L / engines per node. An SGLang engine uses the devices
[owner's local rank, + gpus_per_engine) of its node (its `base_gpu_id` and `tp_size`); an HF
engine runs in its owner process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePlacement:
    """The resolved placement. `owners[e]` is the global rank that owns engine e."""

    num_engines: int
    gpus_per_engine: int
    nodes: int
    procs_per_node: int
    owners: tuple[int, ...]

    def engine_of(self, rank: int) -> int | None:
        """The engine `rank` owns, or None."""
        return self.owners.index(rank) if rank in self.owners else None

    def local_slot(self, engine: int) -> int:
        """The owner's local rank: the first device of the engine on its node."""
        return self.owners[engine] % self.procs_per_node

    def describe(self, cuda: bool = True) -> str:
        """One line for the launch log; `cuda` False (a CPU host): an engine's slots are
        ranks' processes, not GPUs."""
        per_node = max(1, self.num_engines // self.nodes)
        unit = "GPU(s)" if cuda else "CPU rank(s)"
        return (f"{self.num_engines} rollout engine(s) ({per_node} per node where hosted), "
                f"{self.gpus_per_engine} {unit} per engine, owner ranks "
                f"{list(self.owners)}")


def placement_problems(num_engines: int | None, gpus_per_engine: int | None, world_size: int,
                       procs_per_node: int) -> list[str]:
    """Every reason the placement cannot be built, as sentences naming the keys."""
    p: list[str] = []
    if procs_per_node < 1 or world_size % procs_per_node:
        return [f"world size {world_size} is not a whole number of nodes of {procs_per_node} "
                "processes (torchrun --nproc_per_node)"]
    nodes = world_size // procs_per_node
    for key, value in (("num_engines", num_engines), ("gpus_per_engine", gpus_per_engine)):
        if value is not None and (not isinstance(value, int) or value < 1):
            p.append(f"rollout.{key}={value!r} must be null or an integer >= 1")
    if p:
        return p
    engines = nodes if num_engines is None else num_engines
    if engines <= nodes:
        if nodes % engines:
            valid = [d for d in range(1, nodes + 1) if nodes % d == 0]
            p.append(f"rollout.num_engines={engines} must divide the {nodes} nodes or be a "
                     f"multiple of them (engines never span nodes); valid up to {nodes}: "
                     f"{valid}, or {nodes * 2}, {nodes * 3}, ...")
            return p
        per_node = 1
    else:
        if engines % nodes:
            p.append(f"rollout.num_engines={engines} must be a multiple of the {nodes} nodes "
                     f"(every node hosts as many engines) or divide it; nearest valid: "
                     f"{engines // nodes * nodes} or {(engines // nodes + 1) * nodes}")
            return p
        per_node = engines // nodes
    gpus = gpus_per_engine if gpus_per_engine is not None else max(1, procs_per_node // per_node)
    if per_node * gpus > procs_per_node:
        p.append(f"rollout.num_engines={engines} on {nodes} node(s) puts {per_node} engine(s) "
                 f"on a node; with rollout.gpus_per_engine={gpus} they need {per_node * gpus} "
                 f"devices but a node runs {procs_per_node} processes; lower one of them "
                 f"(at most {procs_per_node // per_node} GPUs per engine at {per_node} per node)")
    return p


def resolve_placement(num_engines: int | None, gpus_per_engine: int | None, world_size: int,
                      procs_per_node: int) -> EnginePlacement:
    """The placement for these keys; raises ValueError listing the problems."""
    problems = placement_problems(num_engines, gpus_per_engine, world_size, procs_per_node)
    if problems:
        raise ValueError("; ".join(problems))
    nodes = world_size // procs_per_node
    engines = nodes if num_engines is None else num_engines
    per_node = max(1, engines // nodes)
    gpus = gpus_per_engine if gpus_per_engine is not None else max(1, procs_per_node // per_node)
    if engines <= nodes:
        owners = tuple(e * (nodes // engines) * procs_per_node for e in range(engines))
    else:
        owners = tuple((e // per_node) * procs_per_node + (e % per_node) * gpus
                       for e in range(engines))
    return EnginePlacement(engines, gpus, nodes, procs_per_node, owners)


def procs_per_node(world_size: int) -> int:
    """Processes per node: torchrun's LOCAL_WORLD_SIZE, else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def split_sizes(cfg, world: int) -> tuple[int, int]:
    """(training ranks, rollout ranks) of a job of `world` processes; (world, 0) colocated or
    while rollout.num_ranks is invalid (its problem is reported by engine.rl.disaggregated.checks.async_problems)."""
    r = cfg.rollout
    n = r.num_ranks
    if r.placement != "disaggregated" or not isinstance(n, int) or not 0 < n < world:
        return world, 0
    return world - n, n


def rollout_procs_per_node(world: int, n_rollout: int) -> int:
    """The rollout world's processes per node (as engine.rl.disaggregated.world numbers them)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n_train = world - n_rollout
    return local if n_rollout % local == 0 and n_train % local == 0 else n_rollout
