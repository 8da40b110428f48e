"""What the RL engine adds to vLLM's worker, in vLLM's worker process (vllm.LLM's
`worker_extension_cls`; engine.generation.vllm.backend calls these by name through
`collective_rpc`).

- `rl_install_contract_logprobs`: the runner's top-k/top-p sampler wrapped by
  `ContractLogprobs`, so the log-probs are log_softmax(logits / T) before top-p (the contract
  of engine.generation.base), the sampled token still vLLM's; refused when the sampler has no
  such module or calls it otherwise (engine.generation.vllm.version). The sampler's
  `apply_logits_processors` is wrapped too (`keep_unshaped`): a batch that is not all greedy
  keeps its logits / T from before vLLM's processors (penalties, logit bias, min-tokens mask;
  min-p later), and ContractLogprobs reports log_softmax of those, so a `serve` request's
  sampling fields move the draw only; without fields the numbers are bitwise the same. `rl_contract_calls`: how
  often it ran (the owner checks its first generate went through it).
- `rl_leave_signals_to_owner`: SIGTERM and SIGINT ignored in the worker. torchrun (and a
  cluster scheduler, and Ctrl-C) signal the whole process group, the engine's worker included;
  vLLM's own handler ends the worker at once, so a rank that was told "finish the step, save,
  exit 0" (engine.run.run_loop) found its engine dead mid-step and exited 1. The owner ends the
  worker: vLLM's executor shutdown asks it to exit, and kills it if it does not (SIGKILL);
  vLLM's death pipe ends it when the owner dies.
- `rl_exit_without_teardown`: on CPU the worker process ends without the interpreter's final
  collection and module teardown once vLLM's orderly shutdown is done (vllm.worker_exit):
  an engine's shutdown no longer waits out vLLM's 5 s grace and the SIGTERM after it.
- `rl_attention_backends`: the backend each attention layer runs (vllm.attention's choice,
  checked by the tests on the engine vLLM built).
- `rl_load_shared_bucket` / `rl_load_bucket` / `rl_close_sync`: one exact weight sync
  (engine.generation.vllm.sync); a bucket arrives as shared tensors (rollout.sync_transport=
  handle: engine.generation.sync.handles, only handles and the layout through the RPC) or as a
  file (`file`: engine.generation.sync.bucket_files, only its path through the RPC);
  `rl_held_buckets`, after the close: the shared buckets this worker still references (the
  worker's side of the buffers' lifetime, engine.generation.sync.lifetime.WorkerViews).
- `rl_weight_digest`: one SHA-256 of the model's parameters and buffers (names, dtypes, shapes,
  bytes), to compare two engines' or two syncs' weights bitwise (tests, debugging); with
  `draft=True` the speculative drafter's own ones (without the modules it shares).
- speculative decoding (rollout.vllm.speculative): `rl_install_spec_contract` makes the
  rejection sampler's log-probs the contract's (engine.generation.vllm.spec_sampler: vLLM's
  broken CPU expand_batch_to_tokens replaced where it is broken, the unfiltered logits at draft
  positions) and says whether it had to replace it; a sync routes the MTP layers' tensors into
  the MTP drafter (engine.generation.vllm.spec_sync); `rl_draft_synced`: whether the last
  closed sync wrote the drafter.
"""
from __future__ import annotations

import hashlib
import signal

import torch
from vllm.platforms import current_platform

from engine.generation.sync.bucket_files import read_bucket
from engine.generation.sync.handles import SharedBucket, open_bucket
from engine.generation.sync.lifetime import WorkerViews
from engine.generation.vllm.spec_sampler import install as install_spec_contract
from engine.generation.vllm.spec_sync import DraftModules, DraftRouter
from engine.generation.vllm.version import sampler_problem
from engine.generation.vllm.worker_exit import install as install_worker_exit


class ContractLogprobs(torch.nn.Module):
    """Wraps vLLM's TopKTopPSampler: returns its sampled tokens and log_softmax of the logits it
    is given (already divided by T), computed before top-k/top-p filter them in place."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        inner.logprobs_mode = "raw_logprobs"  # the wrapped sampler computes no log-probs
        self.inner = inner
        self.unshaped: torch.Tensor | None = None   # this batch's logits / T (keep_unshaped)

    calls = 0   # forward calls: the owner checks the contract carried the first generate

    def forward(self, logits, generators, k, p):
        ContractLogprobs.calls += 1
        unshaped, self.unshaped = self.unshaped, None
        source = logits if unshaped is None else unshaped
        logprobs = source.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = self.inner(logits, generators, k, p)
        return sampled, logprobs


def keep_unshaped(sampler, contract: ContractLogprobs) -> None:
    """Wrap `sampler.apply_logits_processors` (module docstring): before vLLM's processors
    run, a batch that is not all greedy leaves its float32 logits divided by the temperature
    as vLLM's sampler divides them (a greedy row's T read as 1) in `contract.unshaped`."""
    original = sampler.apply_logits_processors

    def apply(logits, sampling_metadata, *args, **kwargs):
        contract.unshaped = None
        if not sampling_metadata.all_greedy:
            temperature = sampling_metadata.temperature
            if not sampling_metadata.all_random:   # vLLM's _SAMPLING_EPS
                temperature = torch.where(temperature < 1e-5, 1.0, temperature)
            contract.unshaped = logits / temperature.unsqueeze(dim=1)
        return original(logits, sampling_metadata, *args, **kwargs)

    apply.rl_keeps_unshaped = True
    sampler.apply_logits_processors = apply


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class (it has `model_runner` and `vllm_config`)."""

    rl_sync: DraftRouter | None = None
    rl_views: WorkerViews | None = None   # the shared buckets this sync opened (lazily)
    rl_last_draft_written = False   # whether the last closed sync wrote the MTP drafter

    def rl_install_contract_logprobs(self) -> None:
        sampler = self.model_runner.sampler
        problem = sampler_problem(sampler)
        if problem and not isinstance(getattr(sampler, "topk_topp_sampler", None),
                                      ContractLogprobs):
            raise RuntimeError(problem)
        if not isinstance(sampler.topk_topp_sampler, ContractLogprobs):
            sampler.topk_topp_sampler = ContractLogprobs(sampler.topk_topp_sampler)
        if not getattr(sampler.apply_logits_processors, "rl_keeps_unshaped", False):
            keep_unshaped(sampler, sampler.topk_topp_sampler)

    def rl_contract_calls(self) -> int:
        return ContractLogprobs.calls

    def rl_install_spec_contract(self) -> bool:
        """The contract on the rejection sampler (speculative engines only); True when vLLM's
        expand_batch_to_tokens was broken here and replaced."""
        sampler = getattr(self.model_runner, "rejection_sampler", None)
        if sampler is None:
            raise RuntimeError("a speculative engine without a rejection_sampler on its runner")
        return install_spec_contract(sampler)["expand_patched"]

    def rl_spec_contract_calls(self) -> int:
        """Rejection-sampler forwards whose draft log-probs came from the unfiltered logits."""
        hook = getattr(getattr(self.model_runner, "rejection_sampler", None),
                       "rl_contract_hook", None)
        return hook.calls if hook is not None else 0

    def rl_draft_model(self) -> torch.nn.Module | None:
        """The MTP drafter's model (method mtp), else None (no speculation, or a separate
        draft model, which is not the policy's and is never synced)."""
        spec = self.vllm_config.speculative_config
        drafter = getattr(self.model_runner, "drafter", None)
        if spec is None or spec.method != "mtp" or drafter is None:
            return None
        return drafter.model

    def rl_draft_synced(self) -> bool:
        return self.rl_last_draft_written

    def rl_leave_signals_to_owner(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    def rl_exit_without_teardown(self) -> bool:
        """On CPU, at its exit this worker process skips the interpreter's teardown
        (engine.generation.vllm.worker_exit); True the first time in a process. GPU workers
        keep vLLM's exit (not run there)."""
        return current_platform.is_cpu() and install_worker_exit()

    def rl_attention_backends(self) -> dict[str, str]:
        """The attention backend of every attention layer this worker built (its model's and a
        speculative draft's: vLLM registers both in the static forward context), by layer name
        (vLLM's AttentionBackend.get_name(), e.g. "CPU_MLA")."""
        layers = self.vllm_config.compilation_config.static_forward_context
        return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()
                if callable(getattr(layer, "get_attn_backend", None))}

    def rl_load_bucket(self, path: str, names: list[str]) -> None:
        """Load one bucket, bucket_files.write_bucket's file (mapped, not copied; the owner
        deletes it once every worker has loaded it); the first bucket of a sync opens it."""
        self.rl_load(read_bucket(path, names))

    def rl_load_shared_bucket(self, bucket: SharedBucket) -> None:
        """Load one bucket of shared tensors (sync.handles: this worker's handle, by its rank;
        views of the owner's buffer, not copies; the owner holds it until every worker
        returned); the first bucket of a sync opens it."""
        tensors = open_bucket(bucket, self.rank)
        if self.rl_views is None:
            self.rl_views = WorkerViews()
        self.rl_views.open(bucket.token, tensors[0][1].untyped_storage())
        self.rl_load(tensors)

    def rl_held_buckets(self) -> list[int]:
        """After `rl_close_sync`: the owner's tokens of the shared buckets this worker still
        has a view of (the owner never reuses those buffers); forgets them all."""
        return self.rl_views.still_viewed() if self.rl_views is not None else []

    def rl_load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Load [(HF name, full tensor), ...] into the open sync (none: open one)."""
        if self.rl_sync is None:
            self.rl_sync = DraftRouter(self.model_runner.get_model(), self.rl_draft_model(),
                                       self.vllm_config, current_platform.is_cpu())
        self.rl_sync.load(bucket)

    def rl_close_sync(self) -> list[str]:
        """Close the open sync (none: nothing); the names it left unwritten."""
        if self.rl_sync is None:
            return []
        sync, self.rl_sync = self.rl_sync, None
        self.rl_last_draft_written = sync.draft_written
        return sync.close()

    def rl_weight_digest(self, draft: bool = False) -> str:
        """SHA-256 over this worker's model parameters and buffers (`draft`: the MTP drafter's
        own, without the target's modules it shares), in name order: each name, dtype, shape
        and bytes (equal digests: bitwise equal weights)."""
        digest = hashlib.sha256()
        model = self.model_runner.get_model()
        if draft:
            if self.rl_draft_model() is None:
                raise RuntimeError("rl_weight_digest(draft=True): this engine has no MTP drafter")
            model = DraftModules(self.rl_draft_model(), model)
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        for name in sorted(tensors):
            t = tensors[name].detach().contiguous().cpu()
            digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
