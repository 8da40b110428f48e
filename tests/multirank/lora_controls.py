"""Negative controls of the LoRA layout harness (tests/multirank/lora_check.py): each breaks one
thing a layout needs on an engine already built, and the harness shows the run then differs
from the single process."""
from __future__ import annotations

import os


def unsummed(engine) -> None:
    """Negative control: the adapter matrices that see only this rank's sequence shard under
    sequence parallelism (column A, row B) lose their `sequence_parallel` tag, so megatron no
    longer sums their gradients over TP (models.lora.adapters)."""
    from models.lora.sites import adapters

    for chunk in engine.chunks:
        for _, adapter in adapters(chunk):
            for p in adapter.parameters():
                p.sequence_parallel = p.sequence_parallel and adapter.kind == "replicated"


def wrong_expert(engine, adapter_dir: str) -> None:
    """Negative control: reload every expert adapter from the PEFT adapter by its LOCAL expert
    index (the classic EP bug: each EP rank takes experts 0 .. E/ep - 1)."""
    from safetensors.torch import load_file

    from models.lora.peft_experts import expert_names, layer_experts, unpack

    stored = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    for chunk in engine.chunks:
        model = chunk
        while hasattr(model, "module"):
            model = model.module
        for layer, param, items, experts, present in layer_experts(model,
                                                                   model.decoder.layers):
            name_a, name_b = expert_names(layer, param, present=present)
            total = experts.num_local_experts * experts.ep_group.size()
            for local, (_, adapter) in enumerate(items):
                adapter.set_full(param, *unpack(stored[name_a], stored[name_b], total, local))
