"""One torchrun job split into two worlds: training ranks and rollout ranks (docs/async-rl.md).

With `rollout.placement=disaggregated` the job's last `rollout.num_ranks` processes only run
rollout engines. `init_split_world(n)` gives each side its OWN default process group (over the
job's TCP store, under a per-side prefix), so megatron's parallel_state, the training engine and
every world collective of the trainer cover the training ranks only, and the rollout side's
pool (engine.generation.pool) covers the rollout ranks only; the rollout ranks never import a
training model. A third group, the BRIDGE (gloo, every rank of the job, numbered by the job's
global rank), carries the rollout batches (rollout leader -> training rank 0), control messages and
validation results; a fourth (WEIGHTS, gloo, the same ranks) carries only the weight versions
(training stage senders -> rollout engine owners), so the owners' receiving thread never shares
a group with the main thread. Every bridge wait has a timeout and names its peer
(BridgeTimeout).

Inside each side, os.environ RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE are rewritten to
the side's numbering; JOB_RANK / JOB_WORLD_SIZE keep torchrun's.
"""
from __future__ import annotations

import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import RunError
from parallel import cpu_runtime
from parallel.process_groups import GPU_BACKEND


class BridgeTimeout(RunError):
    """A bridge send/recv did not complete in time: the peer is dead, hung or far behind."""


@dataclass(frozen=True)
class SplitWorld:
    """This process's place in the split job. Ranks: `job_rank` in [0, job_world); training
    ranks are [0, num_train), rollout ranks [num_train, job_world)."""

    role: str            # "train" | "rollout"
    job_rank: int
    job_world: int
    num_train: int
    bridge: object       # ProcessGroupGloo over the whole job: batches, control, validation
    weights: object      # ProcessGroupGloo over the whole job: weight versions only (its
                         # receiving end is a thread of the engine owners: engine.rl.disaggregated.inbox)
    timeout_s: float
    rollout_procs_per_node: int  # the rollout world's processes per node (its placement)
    job_nodes: int = 1   # nodes of the whole job (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE)

    @property
    def rollout_leader(self) -> int:
        """The job rank of rollout-world rank 0 (drives the collector)."""
        return self.num_train

    def side_rank(self, job_rank: int) -> int:
        return job_rank if job_rank < self.num_train else job_rank - self.num_train

    def describe_peer(self, job_rank: int) -> str:
        side = "training" if job_rank < self.num_train else "rollout"
        return f"{side} rank {self.side_rank(job_rank)} (job rank {job_rank})"


def _side_env(rank: int, world: int, n_rollout: int) -> tuple[str, int, int, int]:
    """(role, side rank, side world, side processes per node)."""
    n_train = world - n_rollout
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if rank < n_train:
        return "train", rank, n_train, local if n_train % local == 0 else n_train
    return ("rollout", rank - n_train, n_rollout,
            local if n_rollout % local == 0 and n_train % local == 0 else n_rollout)


def init_split_world(n_rollout: int, timeout_s: float) -> SplitWorld:
    """Start both worlds and the bridge from torchrun's environment (collective over the job)."""
    cpu_runtime.install()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < n_rollout < world:
        raise ValueError(f"rollout.num_ranks={n_rollout} must be in [1, {world - 1}]")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store,
                          timeout=timedelta(seconds=max(timeout_s, 60)))
    # torchrun's env:// rendezvous keys live under this prefix too (one per restart attempt)
    store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
                             "/split", store)
    nodes = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    role, side_rank, side_world, side_local = _side_env(rank, world, n_rollout)
    os.environ.update(JOB_RANK=str(rank), JOB_WORLD_SIZE=str(world), RANK=str(side_rank),
                      WORLD_SIZE=str(side_world), LOCAL_WORLD_SIZE=str(side_local),
                      LOCAL_RANK=str(side_rank % side_local))
    backend = "gloo" if cpu_runtime.is_cpu_host() else GPU_BACKEND
    if backend != "gloo":
        torch.cuda.set_device(side_rank % side_local)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"/{role}", store),
                            rank=side_rank, world_size=side_world,
                            timeout=timedelta(seconds=1800))
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("/bridge", store), rank, world,
                                   timedelta(seconds=max(timeout_s, 1)))
    weights = dist.ProcessGroupGloo(dist.PrefixStore("/weights", store), rank, world,
                                    timedelta(seconds=max(timeout_s, 1)))
    global _ACTIVE
    _ACTIVE = SplitWorld(role, rank, world, world - n_rollout, bridge, weights,
                         float(timeout_s), _side_env(world - 1, world, n_rollout)[3], nodes)
    return _ACTIVE


_ACTIVE: SplitWorld | None = None


def active_split() -> SplitWorld | None:
    """This process's SplitWorld in a disaggregated run, else None."""
    return _ACTIVE


@contextmanager
def _naming_peer(split: SplitWorld, peer: int, what: str, t: float):
    """Turn gloo's errors inside the block into a BridgeTimeout naming job rank `peer`. gloo
    raises RuntimeError on a timeout, and on a closed peer socket either at the wait or already
    when the send / recv is posted (a peer that died before it): both are inside."""
    try:
        yield
    except Exception as e:
        raise BridgeTimeout(
            f"{what}: no answer from {split.describe_peer(peer)} within "
            f"rollout.peer_timeout_s={t:g} s (the peer died, hung or is far behind): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _wait(post, split: SplitWorld, peer: int, what: str, timeout_s: float | None) -> None:
    """`post()` (a send / recv returning its Work) and the wait for it, `timeout_s` (None: the
    bridge's) at most."""
    t = split.timeout_s if timeout_s is None else timeout_s
    with _naming_peer(split, peer, what, t):
        post().wait(timedelta(seconds=t))


def send_tensor(split: SplitWorld, tensor: torch.Tensor, dst: int, tag: int, what: str,
                timeout_s: float | None = None, group=None) -> None:
    """Blocking send of a CPU tensor to job rank `dst` over `group` (default: the bridge)."""
    t = tensor.detach().contiguous().cpu()
    _wait(lambda: (group or split.bridge).send([t], dst, tag), split, dst, what, timeout_s)


def recv_tensor(split: SplitWorld, out: torch.Tensor, src: int, tag: int, what: str,
                timeout_s: float | None = None, group=None) -> torch.Tensor:
    """Blocking receive into the CPU tensor `out` from job rank `src` over `group` (default:
    the bridge); returns `out`."""
    _wait(lambda: (group or split.bridge).recv([out], src, tag), split, src, what, timeout_s)
    return out


def send_object(split: SplitWorld, obj, dst: int, tag: int, what: str,
                timeout_s: float | None = None, group=None) -> None:
    """Pickle `obj` and send it (length, then bytes) to job rank `dst`."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    send_tensor(split, torch.tensor([data.numel()], dtype=torch.int64), dst, tag, what,
                timeout_s, group)
    send_tensor(split, data, dst, tag, what, timeout_s, group)


def recv_object(split: SplitWorld, src: int, tag: int, what: str,
                timeout_s: float | None = None, group=None):
    """The next object job rank `src` sent with `tag` (the length's wait takes `timeout_s`,
    the bytes' the bridge timeout)."""
    n = recv_tensor(split, torch.zeros(1, dtype=torch.int64), src, tag, what, timeout_s, group)
    buf = recv_tensor(split, torch.empty(int(n.item()), dtype=torch.uint8), src, tag, what,
                      None, group)
    return pickle.loads(buf.numpy().tobytes())


class PendingSend:
    """An object send in flight (isend_object): `wait()` before reusing the channel."""

    def __init__(self, split: SplitWorld, works: list, keep: list, dst: int, what: str):
        self.split, self.works, self.keep, self.dst, self.what = split, works, keep, dst, what

    def wait(self, timeout_s: float | None = None) -> None:
        for work in self.works:
            _wait(lambda w=work: w, self.split, self.dst, self.what, timeout_s)
        self.works, self.keep = [], []


def isend_object(split: SplitWorld, obj, dst: int, tag: int, what: str) -> PendingSend:
    """Start sending `obj` to job rank `dst` without waiting for the receiver."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    with _naming_peer(split, dst, what, split.timeout_s):
        works = [split.bridge.send([size], dst, tag), split.bridge.send([data], dst, tag)]
    return PendingSend(split, works, [size, data], dst, what)
