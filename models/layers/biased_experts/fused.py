"""Fused expert tensors on disk (gpt-oss, Qwen3-VL-MoE) <-> the per-expert names the generic
expert mapping uses.

On disk (and in transformers' memory) a gpt-oss layer holds its experts fused, under
`model.layers.{i}.mlp.experts.`:
  gate_up_proj       [E, H, 2I]  x @ W: output column 2j is gate unit j, 2j + 1 linear unit j
  gate_up_proj_bias  [E, 2I]     the same interleave
  down_proj          [E, I, H]
  down_proj_bias     [E, H]
(MXFP4 checkpoints store the two matrices as X_blocks + X_scales; models.formats.quantized's reader
hands them over dequantized, so this module sees the tensors above either way.)

models.layers.experts.mapping reads and writes one tensor per expert, named by the family's
ExpertNaming (`mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`, megatron's [out, in]
orientation). `FusedExpertReader` presents a checkpoint under those names: expert e's gate
weight is gate_up_proj[e][:, 0::2]^T [I, H], its up weight [:, 1::2]^T, its down weight
down_proj[e]^T [H, I], the biases sliced the same way. Only the experts asked for are read
(`get_rows` of the reader below: one expert-parallel rank reads its own experts). The
inverse, `fuse_experts`, turns the bridge's per-expert export stream back into the four
fused tensors of each layer once all E experts of the layer have passed (the bridge exports
every expert of a layer together: EP ranks all-gather them). Pure copies both ways: a round
trip is bitwise.

Qwen3-VL-MoE stores the same two matrices without biases, gate and up concatenated instead of
interleaved (gate unit j at column j, up at I + j): the family's declared
`fused_expert_layout` and `expert_biases` (models.families.moe) pick the variant.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from models.families.base import field
from models.families.registry import moe_family

_VIRTUAL = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\."
                      r"(weight|bias)$")
_FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def uses_fused_experts(hf_config: Any) -> bool:
    fam = moe_family(hf_config)
    return fam is not None and fam.fused_experts_on_disk


def _num_experts(hf_config: Any) -> int:
    return moe_family(hf_config).num_experts(hf_config)


def _gate_up_columns(width: int, proj: str, interleaved: bool):
    """gate_up_proj's columns (last axis) of `proj` ("gate" / "up"); width = 2I."""
    if interleaved:
        return slice(0 if proj == "gate" else 1, None, 2)
    return slice(0, width // 2) if proj == "gate" else slice(width // 2, None)


def _expert_slice(fused: torch.Tensor, proj: str, kind: str, interleaved: bool
                  ) -> torch.Tensor:
    """One expert's megatron-oriented tensor from its fused slice (fused[e])."""
    if proj == "down":
        return fused.t() if kind == "weight" else fused
    columns = _gate_up_columns(fused.shape[-1], proj, interleaved)
    if kind == "weight":
        return fused[:, columns].t()
    return fused[columns]


def _kinds(hf_config: Any) -> tuple[str, ...]:
    return ("weight", "bias") if moe_family(hf_config).expert_biases else ("weight",)


def _interleaved(hf_config: Any) -> bool:
    return moe_family(hf_config).fused_expert_layout == "interleaved"


class FusedExpertReader:
    """A reader (keys / __contains__ / get) over a checkpoint reader whose fused expert
    tensors read as per-expert tensors (module docstring)."""

    def __init__(self, reader, hf_config: Any):
        self.reader = reader
        self._interleaved = _interleaved(hf_config)
        self._hidden = int(field(hf_config, "hidden_size"))
        self._width = moe_family(hf_config).expert_width(hf_config)
        experts = _num_experts(hf_config)
        layers = int(field(hf_config, "num_hidden_layers"))
        fused = {f"model.layers.{i}.mlp.experts.{n}" for i in range(layers) for n in _FUSED}
        keys = list(reader.keys())
        virtual = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.{k}" for i in range(layers)
                   if f"model.layers.{i}.mlp.experts.gate_up_proj" in keys
                   for e in range(experts) for p in ("gate", "up", "down")
                   for k in _kinds(hf_config)]
        self._keys = [k for k in keys if k not in fused] + virtual

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def get(self, name: str) -> torch.Tensor:
        match = _VIRTUAL.match(name)
        if match is None:
            return self.reader.get(name)
        head, expert, proj, kind = match.groups()
        stored = head + ("down_proj" if proj == "down" else "gate_up_proj")
        stored += "_bias" if kind == "bias" else ""
        e = int(expert)
        fused = _rows(self.reader, stored, e, e + 1)[0]
        if kind == "weight" and fused.shape[-1] != (2 * self._width if proj != "down"
                                                    else self._hidden):
            raise ValueError(
                f"{stored}: expert shape {tuple(fused.shape)} is not the published layout "
                f"(gate_up_proj [E, hidden, 2 x width], down_proj [E, width, hidden]; hidden "
                f"{self._hidden}, width {self._width}); a checkpoint saved by transformers 5 "
                "holds some families' fused experts transposed: save it as published")
        return _expert_slice(fused, proj, kind, self._interleaved).contiguous()


def lora_row_orders(hf_config: Any) -> dict:
    """{"experts.gate_up_proj": Megatron's rows as HF's} for gpt-oss's expert adapters
    (models.lora.adapters.Slice.order): a peft adapter's B of gate_up_proj has the fused
    tensor's 2I output columns (gate unit j at 2j, linear unit j at 2j + 1), Megatron's
    linear_fc1 [gate; up]; {} for other families."""
    if not uses_fused_experts(hf_config) or not _interleaved(hf_config):
        return {}   # concatenated [gate; up] columns are megatron's own row order
    width = int(field(hf_config, moe_family(hf_config).expert_width_field))
    return {"experts.gate_up_proj": tuple(2 * j for j in range(width))
            + tuple(2 * j + 1 for j in range(width))}


def _rows(reader, name: str, start: int, stop: int) -> torch.Tensor:
    if hasattr(reader, "get_rows"):
        return reader.get_rows(name, start, stop)
    return reader.get(name)[start:stop]


def fused_expert_reader(hf_config: Any, reader):
    """`reader` itself, or for fused experts on disk a FusedExpertReader over it."""
    return FusedExpertReader(reader, hf_config) if uses_fused_experts(hf_config) else reader


def _fuse(parts: dict[tuple[int, str, str], torch.Tensor], experts: int, interleaved: bool,
          biases: bool) -> dict[str, torch.Tensor]:
    """The fused tensors of one layer from its per-expert tensors."""
    def stack(proj: str, kind: str) -> torch.Tensor:
        return torch.stack([parts[(e, proj, kind)] for e in range(experts)])

    def pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:   # along the last axis
        if interleaved:
            return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()
        return torch.cat([gate, up], dim=-1).contiguous()

    gate, up = stack("gate", "weight"), stack("up", "weight")            # [E, I, H]
    out = {"gate_up_proj": pair(gate.transpose(1, 2), up.transpose(1, 2)),   # [E, H, 2I]
           "down_proj": stack("down", "weight").transpose(1, 2).contiguous()}  # [E, I, H]
    if biases:
        out["gate_up_proj_bias"] = pair(stack("gate", "bias"), stack("up", "bias"))  # [E, 2I]
        out["down_proj_bias"] = stack("down", "bias").contiguous()
    return out


def fuse_experts(hf_config: Any, stream: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The bridge's export stream with each layer's per-expert tensors replaced by the layer's
    fused tensors for a family with fused experts on disk (others: the stream unchanged).
    Raises if a layer's experts are incomplete at the end (a bug: the bridge exports whole
    layers)."""
    if not uses_fused_experts(hf_config):
        yield from stream
        return
    experts = _num_experts(hf_config)
    per_expert = 3 * len(_kinds(hf_config))
    interleaved, biases = _interleaved(hf_config), len(_kinds(hf_config)) == 2
    pending: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
    for name, tensor in stream:
        match = _VIRTUAL.match(name)
        if match is None:
            yield name, tensor
            continue
        head, expert, proj, kind = match.groups()
        parts = pending.setdefault(head, {})
        parts[(int(expert), proj, kind)] = tensor
        if len(parts) == experts * per_expert:
            for suffix, fused in _fuse(pending.pop(head), experts, interleaved, biases).items():
                yield head + suffix, fused
    if pending:
        raise ValueError(f"fused expert export: incomplete experts in {sorted(pending)[:2]} "
                         f"({[len(p) for p in pending.values()][:2]} of "
                         f"{experts * per_expert} tensors)")
