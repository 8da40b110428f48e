"""The parallel layout of one run: tp x pp x cp x dp = world size.

`ParallelLayout` is a pure value: it validates itself and explains every violated constraint,
so configuration errors surface before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout that cannot run; the message lists every violated constraint."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension. `dp` is derived: world_size / (tp * pp * cp).

    Rank order follows megatron parallel_state's default "tp-cp-ep-dp-pp". Expert parallelism
    (`ep`) is carved out of DP x CP as megatron does: the experts of an MoE layer are split
    over `ep` ranks, expert weights are data-parallel over (dp x cp) / ep ranks, and expert
    weights are tensor-parallel over the same `tp` as the dense layers.
    `sequence_parallel`: Megatron's TP sequence parallelism (resolved: the config's null is
    already turned into on/off); it needs tp > 1 and sequences split evenly over TP ranks.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def problems(self, num_layers: int | None = None, num_heads: int | None = None,
                 num_kv_heads: int | None = None, seq_length: int | None = None,
                 num_experts: int | None = None) -> list[str]:
        """Every violated constraint, as sentences naming the config key (`parallel.*`).
        `num_experts`: experts per MoE layer (0: a dense model, which needs ep=1; None: not
        checked)."""
        out: list[str] = []
        for key in ("tp", "pp", "cp", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                out.append(f"parallel.{key}={value!r} must be an integer >= 1")
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 1):
            out.append(f"parallel.vpp={self.vpp!r} must be null or an integer >= 1")
        if out:
            return out
        if self.world_size % self.model_parallel_size:
            out.append(
                f"world size {self.world_size} is not divisible by parallel.tp x parallel.pp x "
                f"parallel.cp = {self.tp} x {self.pp} x {self.cp} = {self.model_parallel_size}; "
                f"valid (tp, pp, cp) products divide {self.world_size}: "
                f"{_divisors(self.world_size)} (world size: processes launched, nodes x "
                f"nproc_per_node)")
        out += self._expert_problems(num_experts)
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            out.append(f"parallel.vpp={self.vpp} needs parallel.pp >= 2 (got pp={self.pp})")
        if num_layers is not None:
            chunks = self.pp * (self.vpp or 1)
            if num_layers % chunks:
                out.append(
                    f"the model's num_hidden_layers={num_layers} is not divisible by parallel.pp "
                    f"x parallel.vpp = {self.pp} x {self.vpp or 1} = {chunks}; valid pp x vpp "
                    f"products: {_divisors(num_layers)}")
        if num_heads is not None and num_heads % (self.tp * self.cp):
            out.append(
                f"the model's num_attention_heads={num_heads} is not divisible by parallel.tp x "
                f"parallel.cp = {self.tp} x {self.cp} = {self.tp * self.cp}; valid tp x cp "
                f"products: {_divisors(num_heads)}")
        if num_kv_heads is not None:
            if num_kv_heads % self.tp:
                out.append(
                    f"the model's num_key_value_heads={num_kv_heads} is not divisible by "
                    f"parallel.tp={self.tp} (fused QKV is split per query group); valid tp: "
                    f"{_divisors(num_kv_heads)}")
        if self.sequence_parallel and self.tp == 1:
            out.append("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits "
                       "activations over the tensor-parallel ranks); use null (on whenever "
                       "tp > 1) or false, or raise parallel.tp")
        out += self._seq_length_problems(seq_length)
        return out

    def _seq_length_problems(self, seq_length: int | None) -> list[str]:
        """train.seq_length splits evenly: into 2 x cp zigzag chunks with context
        parallelism, and each CP shard over the TP ranks with sequence parallelism."""
        sp = self.sequence_parallel and self.tp > 1
        if seq_length is None or (self.cp == 1 and not sp):
            return []
        step = (2 * self.cp if self.cp > 1 else 1) * (self.tp if sp else 1)
        if seq_length % step == 0:
            return []
        lower, upper = seq_length // step * step, (seq_length // step + 1) * step
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        if sp and self.cp > 1:
            rule = (f"2 x parallel.cp x parallel.tp = {step} (zigzag context-parallel "
                    "sharding, then sequence parallelism over TP)")
        elif sp:
            rule = f"parallel.tp = {step} (sequence parallelism over TP)"
        else:
            rule = f"2 x parallel.cp = {step} (zigzag context-parallel sharding)"
        return [f"train.seq_length={seq_length} must be divisible by {rule}; nearest valid: "
                f"{nearest}"]

    def _expert_problems(self, num_experts: int | None) -> list[str]:
        """parallel.ep constraints: it divides dp x cp (megatron carves expert parallelism
        out of the data- and context-parallel ranks) and the model's experts per layer."""
        if self.ep == 1:
            return []
        out = []
        dpcp = self.dp * self.cp
        if self.world_size % self.model_parallel_size == 0 and dpcp % self.ep:
            out.append(
                f"parallel.ep={self.ep} must divide dp x cp = {self.dp} x {self.cp} = {dpcp} "
                f"(expert parallelism is carved out of the data- and context-parallel ranks); "
                f"valid ep: {_divisors(dpcp)}")
        if num_experts == 0:
            out.append(f"parallel.ep={self.ep} needs a mixture-of-experts model (this model "
                       "has no experts); valid: parallel.ep=1")
        elif num_experts is not None and num_experts % self.ep:
            out.append(f"the model's num_experts={num_experts} is not divisible by "
                       f"parallel.ep={self.ep}; valid ep: {_divisors(num_experts)}")
        return out

    def validate(self, **model_dims) -> "ParallelLayout":
        """Raise `LayoutError` listing every problem; return self when the layout is valid."""
        problems = self.problems(**model_dims)
        if problems:
            raise LayoutError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
        return self

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"world={self.world_size} dp={self.dp} tp={self.tp} pp={self.pp}{vpp} "
                f"cp={self.cp}{ep}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
