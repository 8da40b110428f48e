"""Only what changed crosses machines (rollout.sync_delta; engine.rl.disaggregated.weight_send
sends, engine.rl.disaggregated.inbox receives; docs/async-rl.md#weights).

Per tensor the sender sends ONE of three encodings, whichever has the fewest bytes (ties: full):

- `full`: the tensor's raw bytes (numel x element size);
- `index`: the int32 flat positions of the k changed elements, then their k new values
  (4 k + k x element size bytes; only for tensors of fewer than 2**31 elements);
- `mask`: a bitmask of the changed elements (numel / 8 bytes, rounded up; bit i of byte j is
  element 8 j + i), then their k new values in position order.

So `index` wins below about 1/32 of the elements changed, `mask` above it, and `full` at bf16
above 1 - 1/16 (fp32: 1 - 1/32); `index` against full alone would stop at 1/3 (bf16). "Changed"
is BITWISE in the dtype the tensor is sent in (the rollout dtype, after
rollout.sync_quantization): the receiver rebuilds the sent tensor bit for bit (-0.0 / +0.0
and NaN payloads included), so the engine loads exactly what a full sync loads.

A delta is relative to a BASE: the version the receiver holds (its last received version).
`SenderBases` keeps the sender's last sent tensors (one host copy of the sender's stage in the
sent dtype, shared by its receivers, which receive the same versions) and per receiver the
version it holds; a receiver it has not sent to (a fresh job, a resumed one) gets full tensors.
`ReceiverBases` keeps the receiver's last received version; `decode` refuses (DeltaRefused) a
delta against a version, name, shape or dtype the receiver does not hold, and never applies it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

FULL, INDEX, MASK = "full", "index", "mask"
KINDS = (FULL, INDEX, MASK)
INDEX_LIMIT = 2 ** 31            # int32 positions
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaRefused(RuntimeError):
    """A delta against a base the receiver does not hold (it is never applied)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flat, viewed as integers of its element size (bitwise comparison and copies)."""
    return t.contiguous().reshape(-1).view(_BITS[t.element_size()])


def payload_bytes(kind: str, numel: int, changed: int, element_size: int) -> int:
    """Bytes on the wire of one tensor of `numel` elements with `changed` of them changed."""
    if kind == FULL:
        return numel * element_size
    if kind == INDEX:
        return changed * (4 + element_size)
    if kind == MASK:
        return (numel + 7) // 8 + changed * element_size
    raise ValueError(f"encoding {kind!r} must be one of {list(KINDS)}")


def choose(numel: int, changed: int, element_size: int) -> str:
    """The encoding with the fewest bytes (ties: full, then index)."""
    kinds = [FULL, INDEX, MASK] if numel < INDEX_LIMIT else [FULL, MASK]
    return min(kinds, key=lambda k: payload_bytes(k, numel, changed, element_size))


@dataclass
class Encoded:
    """One tensor on the wire: its encoding, its changed elements (numel for a full tensor
    without a base) and the payload (a flat uint8 CPU tensor)."""

    kind: str
    changed: int
    payload: torch.Tensor
    positions: torch.Tensor | None = None   # a delta's flat positions (int64; not sent)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def encode(new: torch.Tensor, old: torch.Tensor | None) -> Encoded:
    """`new` (a CPU tensor in the sent dtype) against the receiver's `old` (None: no base)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return Encoded(FULL, new.numel(), _raw(new))
    flat = bits(new)
    mask = flat != bits(old)
    k = int(torch.count_nonzero(mask))   # (bool .sum() is several times slower on CPU)
    kind = choose(new.numel(), k, new.element_size())
    if kind == FULL:
        return Encoded(FULL, k, _raw(new))
    where = torch.from_numpy(np.flatnonzero(mask.numpy()))
    values = flat[where].view(torch.uint8)
    if kind == INDEX:
        sent = where.to(torch.int32).view(torch.uint8)
    else:
        sent = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    return Encoded(kind, k, torch.cat([sent, values]), where)


def decode(kind: str, changed: int, payload: torch.Tensor, shape, dtype: torch.dtype,
           base: torch.Tensor | None) -> torch.Tensor:
    """The sent tensor, rebuilt from `payload` (a flat uint8 tensor) and, for a delta, the
    receiver's `base` of the same shape and dtype (left untouched: the result is a copy)."""
    if kind == FULL:
        return payload.view(dtype).reshape(shape)
    if kind not in KINDS:
        raise DeltaRefused(f"encoding {kind!r} must be one of {list(KINDS)}")
    if base is None or tuple(base.shape) != tuple(shape) or base.dtype != dtype:
        held = "nothing" if base is None else f"{tuple(base.shape)} {base.dtype}"
        raise DeltaRefused(f"a {kind} delta of a {tuple(shape)} {dtype} tensor against a base "
                           f"this receiver holds as {held}: refused, not applied")
    out = base.detach().clone(memory_format=torch.contiguous_format)
    flat = bits(out)
    esize = out.element_size()
    split = len(payload) - changed * esize
    values = payload[split:].clone().view(flat.dtype)   # a copy: aligned for the view
    if kind == INDEX:
        where = payload[:split].view(torch.int32).long()
    else:
        mask = np.unpackbits(payload[:split].numpy(), count=out.numel(), bitorder="little")
        where = torch.from_numpy(np.flatnonzero(mask.view(bool)))
    if len(where) != changed:
        raise DeltaRefused(f"a {kind} delta announcing {changed} changed elements carries "
                           f"{len(where)}: refused, not applied")
    flat[where] = values
    return out


@dataclass
class WireStats:
    """What one sender put on the wire for one version, summed over its receivers: payload
    bytes, changed elements and all elements (changed / elements: sync/changed_fraction)."""

    bytes: int = 0
    changed: int = 0
    elements: int = 0


class SenderBases:
    """A sender's memory of what its receivers hold (module docstring). enabled=False
    (rollout.sync_delta=false): every tensor goes full and nothing is kept."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.version: int | None = None          # the version of `tensors`
        self.tensors: dict[str, torch.Tensor] = {}
        self.held: dict[int, int] = {}           # receiver -> the version it holds

    def base_for(self, receiver: int) -> int | None:
        """The version deltas to `receiver` are against (None: it gets full tensors)."""
        held = self.held.get(receiver)
        return held if self.enabled and held is not None and held == self.version else None

    def encode(self, name: str, tensor: torch.Tensor, delta: bool) -> tuple[Encoded, Encoded]:
        """(the encoding for receivers with a base, the full one), remembering `tensor` as the
        new base of `name` (a host copy). delta=False: no receiver has a base."""
        new = tensor.detach().cpu()   # a copy of a GPU tensor, the tensor itself on CPU
        full = Encoded(FULL, new.numel(), _raw(new))
        old = self.tensors.get(name)
        coded = encode(new, old) if delta else full
        if not self.enabled:
            return coded, full
        if coded.positions is not None:   # the kept buffer takes the changed elements only
            bits(old)[coded.positions] = bits(new)[coded.positions]
        elif old is not None and old.shape == new.shape and old.dtype == new.dtype:
            old.copy_(new)                # reused: no fresh host pages per version
        else:                             # (contiguous: bits() is then a view of it)
            self.tensors[name] = (new.clone(memory_format=torch.contiguous_format)
                                  if new.device == tensor.device else new.contiguous())
        return coded, full

    def sent(self, version: int, receivers: list[int]) -> None:
        """Every tensor of `version` went to `receivers`: they hold it now."""
        if self.enabled:
            self.version = version
            self.held.update({r: version for r in receivers})


@dataclass
class ReceiverBases:
    """A receiver's last received version and its tensors by name (the bases of the next
    deltas; the tensors are those handed to the engine, shared, not copied)."""

    version: int | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def base(self, name: str, against: int | None, version: int) -> torch.Tensor:
        """The base of a delta of `name` in `version` that the sender made against version
        `against`; DeltaRefused when this receiver does not hold it."""
        if against is None or against != self.version or name not in self.tensors:
            holds = "no version" if self.version is None else f"version {self.version}"
            raise DeltaRefused(f"weight version {version}: a delta of {name} against version "
                               f"{against}, but this receiver holds {holds}"
                               f"{'' if name in self.tensors else ' without that tensor'}: "
                               "refused, not applied (a receiver that joins late or restarts "
                               "must get full tensors first)")
        return self.tensors[name]


def delta_enabled(setting: bool | None, job_nodes: int) -> bool:
    """rollout.sync_delta resolved: true / false as set; null (auto) on when the job spans
    more than one node, where the weights cross machines (on one machine a delta costs more
    time to compute than the smaller transfer saves: docs/async-rl.md)."""
    return job_nodes > 1 if setting is None else bool(setting)
