"""The frozen reference's completion log-prob sums of one global batch (docs/preference.md), for
DPO and KTO.

Computed once per step, before the update, forward-only at the trainer's layout and with the
step's own planning units (DPO's pairs stay in one micro-batch), without LoRA dropout. The
reference is
- with LoRA from model.lora.init_from: the policy with that STARTING adapter, frozen (as TRL's
  DPOTrainer copies a pretrained adapter into a frozen "ref" adapter): a second copy of the
  adapter matrices (rank r) inside the policy's own adapters, read from the folder (also after
  a resume, never from the checkpoint: models.lora.peft.load_reference_adapter) and swapped in
  for the reference pass (models.lora.modes.reference_adapters); step 1's policy is the
  reference, so its log-ratios are 0 (sigmoid loss ln 2);
- with fresh LoRA adapters (model.lora.rank > 0, no init_from): the policy's own base, its
  adapters switched off (models.lora.modes.adapters_disabled), which is the initial policy
  (B = 0): no second model, no extra memory;
- otherwise a frozen copy of dpo.ref_path / kto.ref_path (default: model.hf_path, the initial
  policy; also after a resume), built at the policy's layout (TrainEngine.frozen): one more
  copy of the weights per rank, no gradients or optimizer state;
- none for DPO's reference-free loss types (simpo, orpo).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.config.fusion_settings import fusion_overrides
from engine.config.model_settings import megatron_overrides
from engine.config.moe_settings import moe_overrides
from engine.training.micro_batches import SequenceData
from engine.training.token_losses import token_logprobs
from engine.training.train_engine import BatchSettings, TrainEngine
from models.hf.conditional import peft_layers
from models.lora.modes import adapters_disabled, reference_adapters
from models.lora.peft import load_reference_adapter
from parallel import cpu_runtime


def completion_logprob_sums(engine: TrainEngine, seqs: list[SequenceData],
                            units: list[list[int]]) -> torch.Tensor:
    """[len(seqs)] float64 CPU tensor, identical on every rank: the sum of log p(label) over
    each sequence's trained tokens (loss_mask), from `engine`'s forward-only pass.

    Every TP rank computes the log-probs (a TP collective); only TP rank 0 of the last pipeline
    stage writes them (output_fn runs on the last stage only);
    CP shards of one sequence and DP ranks' sequences add up in one all-reduce over the world,
    so each token has exactly one contributor. Collective over the whole world."""
    table = torch.zeros(len(seqs), dtype=torch.float64, device=cpu_runtime.device())
    writer = ps.get_tensor_model_parallel_rank() == 0

    def output_fn(logits, mb):
        # every TP rank: the vocabulary-parallel log-softmax is a TP collective
        logp = token_logprobs(logits, mb.labels, engine.vocab_size).to(torch.float64)
        if not writer:
            return
        ids = mb.seq_ids.reshape(-1).long()
        valid = ids >= 0
        values = logp.reshape(-1) * mb.loss_mask.reshape(-1).to(torch.float64) * valid
        table.index_add_(0, torch.where(valid, ids, torch.zeros_like(ids)), values)

    engine.forward_only(seqs, output_fn=output_fn, units=units)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.cpu()


class Reference:
    """The reference of a DPO or KTO run: `sums(seqs, units)` as above, or None (reference-free).

    engine: the frozen reference engine (None with LoRA or reference-free); policy: the
    trained engine (with LoRA the reference runs inside it); `start_adapter`: with LoRA, the
    PEFT adapter folder the run started from (model.lora.init_from): it is loaded here, as
    the policy's frozen reference adapter (every rank of the policy constructs a Reference;
    local, no collective); None: the base with the adapters off."""

    def __init__(self, policy: TrainEngine, engine: TrainEngine | None, lora: bool,
                 needed: bool, start_adapter: str | None = None):
        self.policy, self.engine, self.lora, self.needed = policy, engine, lora, needed
        self.start_adapter = start_adapter if lora and needed else None
        if self.start_adapter is not None:
            load_reference_adapter(policy.chunks, self.start_adapter,
                                   peft_layers(policy.hf_config))

    def describe(self) -> str:
        if not self.needed:
            return "none (reference-free loss)"
        if self.start_adapter is not None:
            return (f"the starting adapter ({self.start_adapter}), frozen beside the trained "
                    "one (no second model)")
        if self.lora:
            return "the policy's base with its LoRA adapters off (no second model)"
        return "a frozen copy of the reference weights at the policy's layout"

    def sums(self, seqs: list[SequenceData], units: list[list[int]]) -> torch.Tensor | None:
        if not self.needed:
            return None
        if self.lora:
            mode = adapters_disabled if self.start_adapter is None else reference_adapters
            with mode(self.policy.chunks):
                return completion_logprob_sums(self.policy, seqs, units)
        return completion_logprob_sums(self.engine, seqs, units)


def make_reference(cfg, hf_config: dict, policy: TrainEngine, pad_id: int,
                   ref_path: str | None, needed: bool) -> Reference:
    """A run's reference: none (not `needed`), the starting LoRA adapter (model.lora.init_from,
    read from its folder, also on a resume), the LoRA base (fresh adapters), or a frozen engine
    of `ref_path` (default model.hf_path) at the policy's layout. DPO's and KTO's references."""
    lora = bool(cfg.model.lora.rank)
    engine = None
    if needed and not lora:
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        engine = TrainEngine.frozen(hf_config, dtype, ref_path or cfg.model.hf_path,
                                    BatchSettings.from_config(cfg.train), pad_id,
                                    loss_chunk_tokens=cfg.train.loss_chunk_tokens or None,
                                    **megatron_overrides(cfg.parallel),
                                    **moe_overrides(cfg, hf_config, forward_only=True),
                                    **fusion_overrides(cfg, hf_config))
    return Reference(policy, engine, lora, needed, cfg.model.lora.init_from)
