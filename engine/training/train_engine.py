"""The training engine: model chunks, DDP, optimizer, LR schedule and non-finite guard of one run.

Every optimizer step of the project (SFT, the RL policy update) is `TrainEngine.train_batch`;
every forward-only pass (SFT evaluation, RL old/reference log-probs) is
`TrainEngine.forward_only`, without LoRA dropout. One step, as data flowing:

    seqs (the global mini-batch, same list on every rank)
      -> engine.training.rank_batch.build_rank_batch: DP plan, loss weights (GlobalLossNormalizer over
         the DP group), this rank's padded/packed micro-batches cut to its CP shard
      -> engine.training.schedule.run_micro_batches: megatron's pipeline schedule, loss_fn returns
         weighted sums
      -> engine.training.schedule.reduce_reports: report sums over micro-batches, DP x CP, shared on PP
      -> engine.training.nonfinite.guarded_optimizer_step: grad norm, clip, step (or skip if non-finite)

Gradient contract (see engine.training.loss): DDP with `calculate_per_token_loss=True` sums gradients
over DP x CP; `finalize_grads` calls megatron's `finalize_model_grads` with `num_tokens=None`,
so gradients are never divided by a token or micro-batch count.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

from engine.training.comm_overlap import (OverlapSettings, ddp_config, finish_param_gather,
                                          install_schedule_hooks, p2p_overrides)
from engine.training.compile_report import compile_metrics, release_compile_threads
from engine.training.ddp_release import clear_megatron_caches, release_ddp
from engine.training.loss import GlobalLossNormalizer
from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
from engine.training.micro_batches import MicroBatch, SequenceData
from engine.training.muon import megatron_distributed_optimizer
from engine.training.mtp import (MTP_REPORT_KEYS, MTPTraining, exclude_from_grad_norm,
                                 mtp_metrics)
from engine.training.nonfinite import NonFiniteGuard, guarded_optimizer_step
from engine.training.optimizers import build_optimizer, build_scheduler
from engine.training.rank_batch import build_rank_batch
from engine.training.router_losses import RouterLosses
from engine.training.routing import RoutingReplay
from engine.training.schedule import LossFn, reduce_reports, run_micro_batches
from models.bridge.weights import load_hf_weights
from models.build import wgrad_fp32
from models.build.factory import build_model_chunks
from models.families.mtp import with_trained_mtp
from models.hf.io import SafetensorsReader
from models.lora.adapters import LoraSpec
from models.lora.modes import dropout_disabled
from models.hf.conditional import peft_layers
from models.lora.peft import load_peft_adapter

# output_fn(output_logits [b, s, V/tp] or loss_head.HiddenStates, micro_batch) -> None: sees
# each micro-batch's logits (engine.training.schedule)
OutputFn = Callable[[torch.Tensor, MicroBatch], None]


@dataclass
class BatchSettings:
    """How a global mini-batch becomes micro-batches (train.* keys of SFT and RL)."""

    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    balance_dp: bool = True
    packing: bool = False
    prefix_sharing: bool = False    # rows run as a prefix tree (engine.training.tree_batch)
    # the last layer's MLP only where a loss reads (models.layers.unread_positions)
    skip_unread_positions: bool = True

    @classmethod
    def from_config(cls, train_cfg) -> "BatchSettings":
        return cls(train_cfg.micro_batch_size, train_cfg.max_tokens_per_micro_batch,
                   train_cfg.balance_dp, train_cfg.packing,
                   bool(getattr(train_cfg, "prefix_sharing", False)),
                   bool(getattr(train_cfg, "skip_unread_positions", True)))


def finalize_grads(model, num_tokens=None, **kwargs):
    """Megatron's finalize_model_grads with the token count dropped: our losses are already
    globally normalised weighted sums (engine.training.loss)."""
    return finalize_model_grads(model, None, **kwargs)


def mark_expert_params(chunks: list) -> int:
    """Give every MoE expert weight `allreduce = False`, as megatron does only at
    expert_model_parallel_size > 1; returns how many were marked.

    Megatron's DDP and optimizer put such parameters in their own buffers and optimizer
    (reduced and sharded over the expert-data-parallel group, which at ep 1 is the same
    dp x cp group as the dense weights: the numbers do not change). Doing it at every ep gives
    MoE checkpoints one optimizer layout (a chained dense + expert optimizer), so a
    checkpoint saved at one ep resumes at any other; at ep 1 megatron would otherwise save a
    single optimizer whose keys an ep > 1 run cannot load, and vice versa."""
    marked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "is_expert", False):
                for param in module.parameters(recurse=False):
                    param.allreduce = False
                    marked += 1
    return marked


@dataclass
class TrainEngine:
    """This rank's part of the model and everything that updates it.

    `optimizer`/`scheduler` are None for a frozen engine (e.g. the RL KL reference), which
    supports `forward_only` only. All methods are collective over the whole world (every rank
    passes the same `seqs`)."""

    chunks: list                # GPTModel chunks of this rank (DDP-wrapped unless frozen)
    optimizer: object | None    # megatron optimizer (distributed by default)
    scheduler: object | None    # megatron OptimizerParamScheduler
    hf_config: dict
    batching: BatchSettings
    pad_id: int = 0
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)  # skipped-step accounting
    router_losses: RouterLosses | None = None  # MoE router-loss scaling and metrics (lazy)
    routing: RoutingReplay | None = None  # MoE routing record/replay (enable_routing_replay)
    # tokens per chunk of the loss head (train.loss_chunk_tokens); None: megatron's logits
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    mtp: MTPTraining | None = None  # train the MTP layer too (engine.training.mtp)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def skip_unread(self) -> bool:
        """train.skip_unread_positions (BatchSettings; on where `batching` does not say)."""
        return bool(getattr(self.batching, "skip_unread_positions", True))

    @property
    def sequence_parallel(self) -> bool:
        """Whether the model runs with Megatron TP sequence parallelism (micro-batches are
        then padded so the sequence splits evenly over TP ranks)."""
        return bool(self.chunks[0].config.sequence_parallel)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def optimizer_steps_attempted(self) -> int:
        """Optimizer steps taken plus those skipped as non-finite."""
        return self.scheduler.num_steps + self.guard.skipped

    @classmethod
    def build(cls, hf_config: dict, optim_cfg, dtype: torch.dtype, total_steps: int,
              batching: BatchSettings, pad_id: int = 0, weights_dir: str | None = None,
              load_weights: bool = True, overlap: OverlapSettings | None = None,
              loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
              prepare: Callable[[list], None] | None = None,
              lora: LoraSpec | None = None, lora_init: str | None = None,
              reader=None, mtp: MTPTraining | None = None,
              **model_overrides) -> "TrainEngine":
        """Build this rank's model chunks, load HF weights from `weights_dir` (unless
        `load_weights` is False: a checkpoint will be loaded), wrap them in megatron DDP and
        create the optimizer and an LR schedule over `total_steps` optimizer steps.
        `prepare(raw chunks)` runs after the weights are loaded and before DDP wraps them
        (e.g. models.layers.heads.value.attach_value_heads for a PPO critic).
        `model_overrides` go to the TransformerConfig (e.g. cp_comm_type; sequence
        parallelism and recomputation: engine.config.model_settings.megatron_overrides);
        `overlap`: DDP communication settings (engine.training.comm_overlap; default none);
        `loss_chunk_tokens`: tokens per chunk of the loss head (None: unchunked logits).
        `lora`: attach LoRA adapters (models.lora.sites) and freeze the base, which is then
        always loaded from `weights_dir` (a checkpoint holds only the adapters); `lora_init`: a
        PEFT adapter folder the adapters start from (when `load_weights`). `reader`: what the
        HF weights are read from instead of `weights_dir`'s SafetensorsReader (e.g. a reward
        model's trunk without its score head, models.bridge.critic.TrunkReader). `mtp`: build,
        load and train the checkpoint's MTP layer (models.layers.mtp, engine.training.mtp;
        the engine's hf_config is then marked: models.families.mtp.with_trained_mtp)."""
        overlap = overlap or OverlapSettings()
        if mtp is not None:
            hf_config = with_trained_mtp(hf_config)
        raw = build_model_chunks(hf_config, params_dtype=dtype, lora=lora,
                                 **{**model_overrides, **p2p_overrides(overlap)})
        if load_weights or lora is not None:
            load_hf_weights(raw, reader or SafetensorsReader(weights_dir), hf_config)
        if load_weights and lora_init:
            load_peft_adapter(raw, lora_init, peft_layers(hf_config))
        if prepare is not None:
            prepare(raw)
        if mtp is not None and mtp.detach:
            exclude_from_grad_norm(raw)
        config = raw[0].config
        config.finalize_model_grads_func = finalize_grads
        mark_expert_params(raw)
        wgrad_fp32.enable(raw)  # weight gradients straight into DDP's main_grad, in fp32
        ddp = ddp_config(overlap, megatron_distributed_optimizer(optim_cfg), dtype)
        chunks = [DistributedDataParallel(config, ddp, module=c, disable_bucketing=i > 0)
                  for i, c in enumerate(raw)]
        install_schedule_hooks(chunks, overlap)
        for c in chunks:
            c.broadcast_params()
        optimizer = build_optimizer(chunks, optim_cfg, dtype)
        return cls(chunks, optimizer, build_scheduler(optimizer, optim_cfg, total_steps), hf_config,
                   batching, pad_id, loss_chunk_tokens=loss_chunk_tokens, mtp=mtp)

    @classmethod
    def frozen(cls, hf_config: dict, dtype: torch.dtype, weights_dir: str,
               batching: BatchSettings, pad_id: int = 0,
               loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
               load_weights: bool = True, prepare: Callable[[list], None] | None = None,
               **model_overrides) -> "TrainEngine":
        """A forward-only copy of the HF weights in `weights_dir` (no DDP, no optimizer).
        `prepare(raw chunks)` runs after the weights are loaded (or instead of loading them,
        with `load_weights` False) and before every parameter is frozen, e.g.
        models.bridge.reward_model.load_reward_model, which reads a sequence classifier's
        trunk and score head itself; `loss_chunk_tokens` and `model_overrides` as in `build`."""
        chunks = build_model_chunks(hf_config, params_dtype=dtype, **model_overrides)
        if load_weights:
            load_hf_weights(chunks, SafetensorsReader(weights_dir), hf_config)
        if prepare is not None:
            prepare(chunks)
        for c in chunks:
            c.eval().requires_grad_(False)
        return cls(chunks, None, None, hf_config, batching, pad_id,
                   loss_chunk_tokens=loss_chunk_tokens)

    def train_batch(self, seqs: Sequence[SequenceData],
                    normalizer: GlobalLossNormalizer | torch.Tensor, loss_fn: LossFn,
                    report_keys: Sequence[str], units: list[list[int]] | None = None
                    ) -> dict[str, float]:
        """One optimizer step on the global mini-batch `seqs`.

        `loss_fn(logits, mb)` (logits or a loss_head.HiddenStates) returns (weighted loss
        sum, {key: sum}); the loss driving the guard is report key `report_keys[0]`. Returns
        the report sums reduced over the whole
        mini-batch plus grad_norm, lr (of this step), train/update_skipped,
        train/micro_batches, batch/num_tokens, batch/num_padding, batch/dp_imbalance,
        train/prefix_token_ratio and time/step_s (and for MoE models the moe/* metrics of
        engine.training.router_losses). A non-finite loss or gradient skips the update (weights, Adam state and
        LR schedule untouched) and is counted in `self.guard`; the caller logs the step, then
        calls `self.guard.raise_if_diverged()`. `normalizer`: or fixed per-sequence weights;
        `units`: positions of `seqs` kept in one micro-batch (engine.training.plan)."""
        t0 = time.perf_counter()
        batch = build_rank_batch(list(seqs), normalizer, self.batching, self.pad_id,
                                 sequence_parallel=self.sequence_parallel, units=units,
                                 mtp=self.mtp is not None)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_losses is None:
            self.router_losses = RouterLosses(self.chunks)
        self.router_losses.before_step(batch.micro_batches)
        reports = run_micro_batches(self.chunks, batch.micro_batches, loss_fn,
                                    before_forward=self._routing_hook(seqs),
                                    loss_chunk_tokens=self.loss_chunk_tokens, mtp=self.mtp,
                                    vocab_size=self.vocab_size,
                                    skip_unread=self.skip_unread)
        mtp_keys = list(MTP_REPORT_KEYS) if self.mtp is not None else []
        out = reduce_reports(reports, list(report_keys) + mtp_keys)
        if mtp_keys:
            out.update(mtp_metrics(out))
        out.update(self.router_losses.metrics())
        if self.routing is not None and self.routing.mode == "replay":
            out["moe/replay_mismatch"] = self.routing.mismatch()
        label = self.optimizer_steps_attempted + 1
        out.update(compile_metrics(self.chunks, label))   # train.compile: compile/* counts
        stepped, grad_norm = guarded_optimizer_step(self.optimizer, out[report_keys[0]])
        lr = self.lr
        if stepped:
            self.scheduler.step(increment=1)
        self.guard.record(label, stepped, out[report_keys[0]], grad_norm)
        out.update({
            "grad_norm": grad_norm, "lr": lr, "train/update_skipped": 0.0 if stepped else 1.0,
            "train/micro_batches": float(len(batch.micro_batches)),
            "batch/num_tokens": float(batch.num_tokens),
            "batch/num_padding": float(batch.num_padding),
            "batch/dp_imbalance": batch.plan.dp_imbalance,
            "train/prefix_token_ratio": batch.prefix_token_ratio,
            "time/step_s": time.perf_counter() - t0})
        return out

    def gather_params(self) -> None:
        """Collective over DP x CP: finish the parameter all-gathers that overlap_param_gather
        defers to the next forward pass, so every parameter holds the last step's values
        (call before reading weights outside a forward: checkpoint save, weight sync, export)."""
        finish_param_gather(self.chunks)

    def release(self) -> None:
        """Let this engine's model, gradient buffers and process groups be freed although
        megatron's DDP hooks still point at them (engine.training.ddp_release); the engine
        cannot train or export afterwards. For a process that builds several engines in turn
        (layout sweeps, the test rank pool); a job's last engine ends with its process."""
        for chunk in self.chunks:
            release_ddp(chunk)
        clear_megatron_caches()

    def enable_routing_replay(self) -> RoutingReplay:
        """Attach routing record/replay to this MoE model's routers (engine.training.routing;
        mode None until set: megatron's own routing)."""
        if self.routing is None:
            self.routing = RoutingReplay(self.chunks)
        return self.routing

    def _routing_hook(self, seqs: Sequence[SequenceData]):
        """before_forward of a run over `seqs` when routing replay is recording or replaying."""
        if self.routing is None or self.routing.mode is None:
            return None
        self.routing.start(len(seqs), max(len(s.tokens) for s in seqs))
        return self.routing.begin

    @torch.no_grad()
    def forward_only(self, seqs: Sequence[SequenceData],
                     weights: GlobalLossNormalizer | torch.Tensor | None = None,
                     loss_fn: LossFn | None = None, report_keys: Sequence[str] = (),
                     output_fn: OutputFn | None = None,
                     units: list[list[int]] | None = None) -> dict[str, float]:
        """Forward passes over the global mini-batch `seqs` in this engine's micro-batches
        (memory does not grow with len(seqs)). `weights`: a normalizer or fixed per-sequence
        weights (default token-sum, i.e. 1). `output_fn` sees each micro-batch's logits on
        the last pipeline stage; `loss_fn` reports are reduced like `train_batch`'s; `units`
        as in `train_batch`. LoRA adapters apply no dropout here (model.lora.dropout acts in
        train_batch only; models.lora.modes.dropout_disabled): the pass is deterministic
        and draws no random numbers."""
        if weights is None:
            weights = GlobalLossNormalizer("token-sum")
        self.gather_params()
        batch = build_rank_batch(list(seqs), weights, self.batching, self.pad_id,
                                 sequence_parallel=self.sequence_parallel, units=units)
        with dropout_disabled(self.chunks):
            reports = run_micro_batches(self.chunks, batch.micro_batches, loss_fn or _no_loss,
                                        forward_only=True, output_fn=output_fn,
                                        before_forward=self._routing_hook(seqs),
                                        loss_chunk_tokens=self.loss_chunk_tokens,
                                        skip_unread=self.skip_unread)
        release_compile_threads()   # train.compile: a pass may have compiled (no-grad graphs)
        return reduce_reports(reports, list(report_keys))


def _no_loss(output, mb: MicroBatch):
    return torch.zeros((), device=mb.tokens.device), {}
