"""The weight sync of an engine whose draft is the policy's own MTP layers
(rollout.vllm.speculative.method=mtp), in vLLM's worker process (engine.generation.vllm.worker).

The trainer sends HF-named tensors. With model.mtp.enabled its export carries the MTP layers
too, under the checkpoint's names: `model.layers.{N}.*` .. `model.layers.{N+n-1}.*` (N =
num_hidden_layers; DeepSeek-V3 / Kimi-K2 / GLM-4.5) or `mtp.*` (Qwen3.5). vLLM runs those layers
in its drafter (`model_runner.drafter.model`), a model of its own, whose `load_weights` takes
the same names; the target's `load_weights` skips them. `DraftRouter` sends each tensor of a
bucket to the model that owns it, both in the same sync:

- the target's tensors to the target's LayerwiseSync (engine.generation.vllm.sync), as without
  speculation;
- the MTP tensors to a LayerwiseSync of the drafter, opened at the first MTP tensor of a sync.
  Once opened, every parameter of the drafter must be written before the engine samples again
  (vllm.sync's rule: a partly synced draft is refused, never served). A sync that carries no
  MTP tensor (model.mtp.enabled off) leaves the drafter as it was: the checkpoint's head; the
  owner warns once (engine.generation.vllm.speculative).

vLLM's MTP drafter shares the target's `embed_tokens` and `lm_head` (SpecDecodeBaseProposer:
`_maybe_share_embeddings`, `_maybe_share_lm_head`; the MTP layers' `shared_head.head` is the
target's lm_head module). Loading the MTP layer's `shared_head.head` or `embed_tokens` would
write the target's tensors: the router drops those two names (the target receives its own
`lm_head` / `embed_tokens` in the same sync, and DeepSeek-V3's design, megatron-core's MTP and
vLLM's drafter all tie them to the main ones), and the drafter's sync covers only the drafter's
own modules (`DraftModules`), never the shared ones, which the target's sync owns.
"""
from __future__ import annotations

import re

import torch

from engine.generation.vllm.sync import LayerwiseSync

SHARED_SUFFIXES = ("shared_head.head.weight", "embed_tokens.weight")


class MtpNames:
    """Which HF names are MTP-layer tensors of a model with `layers` decoder layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.layer = re.compile(r"^model\.layers\.(\d+)\.")

    def __call__(self, name: str) -> bool:
        if name.startswith("mtp.") or ".mtp." in name:
            return True
        match = self.layer.match(name)
        return match is not None and int(match.group(1)) >= self.layers

    @staticmethod
    def shared(name: str) -> bool:
        """An MTP layer's copy of the target's head or embedding (dropped: module
        docstring)."""
        return name.endswith(SHARED_SUFFIXES)


class DraftModules(torch.nn.Module):
    """The drafter `draft` seen without the modules it shares with `target`: its
    named_modules / named_parameters skip them, so a LayerwiseSync over it reloads only the
    drafter's own layers; `load_weights` is the drafter's."""

    def __init__(self, draft: torch.nn.Module, target: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "draft", draft)   # not a child: named_modules is filtered
        self.shared_ids = frozenset(id(m) for m in target.modules())

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        for name, module in self.draft.named_modules(prefix=prefix,
                                                     remove_duplicate=remove_duplicate):
            if id(module) not in self.shared_ids:
                yield name, module

    def load_weights(self, weights):
        return self.draft.load_weights(weights)


class DraftRouter:
    """One weight sync of a target model and its MTP drafter (module docstring); `load` takes
    a bucket, `close` returns the names left unwritten in either (the drafter's prefixed
    "draft:")."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, vllm_config,
                 on_cpu: bool) -> None:
        self.target, self.draft, self.vllm_config, self.on_cpu = target, draft, vllm_config, \
            on_cpu
        self.is_mtp = MtpNames(int(vllm_config.model_config.hf_text_config.num_hidden_layers))
        self.target_sync = LayerwiseSync(target, vllm_config, on_cpu)
        self.draft_sync: LayerwiseSync | None = None

    def load(self, bucket) -> None:
        mine, drafts = [], []
        for name, tensor in bucket:
            if self.draft is not None and self.is_mtp(name):
                if not MtpNames.shared(name):
                    drafts.append((name, tensor))
            else:
                mine.append((name, tensor))
        if mine:
            self.target_sync.load(mine)
        if drafts:
            if self.draft_sync is None:
                draft_config = self.vllm_config.speculative_config.draft_model_config
                self.draft_sync = LayerwiseSync(DraftModules(self.draft, self.target),
                                                self.vllm_config, self.on_cpu,
                                                model_config=draft_config)
            self.draft_sync.load(drafts)

    @property
    def draft_written(self) -> bool:
        """Whether this sync carried MTP tensors into the drafter."""
        return self.draft_sync is not None

    def close(self) -> list[str]:
        stale = self.target_sync.close()
        if self.draft_sync is not None:
            stale += [f"draft:{n}" for n in self.draft_sync.close()]
        return stale
