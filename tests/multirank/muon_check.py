"""optim.name=muon in the SFT invariance harness (tests/multirank/sft_invariance.py, flags
`muon` and `muonref`; tests/test_sft_invariance.py asserts the results).

`muon_optim(optim)`: the harness's optimizer keys with megatron-core's Muon (fp32 Newton-Schulz,
`fp32_matmul_prec=highest`, the layout-invariant tp_mode `duplicated`; the full optimizer
state on every DP rank, or with `layer_wise` megatron-core's layer-wise distributed optimizer). `FormulaCheck` (single process only): before every
optimizer step it records the engine's parameters and reduced gradients and advances a copy
with tests/muon_reference.py's plain formulas; after the step it compares the engine's
parameters with that copy (max abs difference relative to each tensor's largest value)."""
from __future__ import annotations

import copy

import torch

from engine.config.optim_settings import MuonConfig
from engine.training.muon import emerging_optimizers_installed, megatron_core_problem
from tests.muon_reference import ReferenceOptimizer

# whether this environment runs optim.name=muon (emerging-optimizers installed, megatron-core
# 0.16): the tests add their Muon specs only then (.ci/run's megatron-core 0.19 subset refuses it)
MUON_RUNS = emerging_optimizers_installed() and megatron_core_problem() is None


def muon_optim(optim, tp_mode: str = "duplicated", layer_wise: bool = False):
    """A copy of the harness's optim namespace that selects megatron-core's Muon
    (`layer_wise`: under its layer-wise distributed optimizer, optim.distributed_optimizer)."""
    out = copy.copy(optim)
    out.name, out.distributed_optimizer = "muon", layer_wise
    out.muon = MuonConfig(fp32_matmul_prec="highest", tp_mode=tp_mode)
    return out


class FormulaCheck:
    """Wraps `state.optimizer.prepare_grads` of a 1-process TrainEngine built with
    `muon_optim`; `rel` is the worst parameter difference from the formulas over the steps,
    `norm_rel` the worst grad-norm difference."""

    def __init__(self, state, optim):
        self.state, self.rel, self.norm_rel = state, 0.0, 0.0
        self.params = {n: p for c in state.chunks for n, p in c.named_parameters()}
        muon_ids = self._muon_param_ids()
        cfg = state.chunks[0].config
        split = (cfg.num_attention_heads // cfg.num_query_groups * cfg.kv_channels,
                 cfg.kv_channels, cfg.kv_channels)
        muon = {n: (split if "linear_qkv.weight" in n else None)
                for n, p in self.params.items() if id(p) in muon_ids}
        assert muon and all(p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter",
                                                         False)
                            for n, p in self.params.items() if n in muon), sorted(muon)
        assert len(muon) < len(self.params)    # embeddings, output layer, norms: AdamW
        self.reference = ReferenceOptimizer(muon, momentum=optim.muon.momentum,
                                            betas=tuple(optim.betas), eps=optim.eps,
                                            clip=optim.clip_grad)
        self.copy = None
        self.pending = None
        original = state.optimizer.prepare_grads

        def prepare_grads():
            self._before_step()
            return original()

        state.optimizer.prepare_grads = prepare_grads

    def _muon_param_ids(self) -> set:
        ids = set()
        for opt in self.state.optimizer.chained_optimizers:
            if type(opt.optimizer).__name__ == "TensorParallelMuon":
                ids |= {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
        return ids

    def _groups(self):
        by_id = {}
        for opt in self.state.optimizer.chained_optimizers:
            for g in opt.optimizer.param_groups:
                for p in g["params"]:
                    by_id[id(p)] = (g["lr"], g["weight_decay"])
        return by_id

    def _before_step(self) -> None:
        if self.copy is None:
            self.copy = {n: p.detach().clone() for n, p in self.params.items()}
        groups = self._groups()
        grads = {n: p.main_grad.detach().clone() for n, p in self.params.items()}
        lr = {n: groups[id(p)][0] for n, p in self.params.items()}
        wd = {n: groups[id(p)][1] for n, p in self.params.items()}
        self.pending = self.reference.step(self.copy, grads, lr, wd)

    def after_step(self, grad_norm: float | None = None) -> None:
        """Compare the engine's parameters with the reference copy after the pending step."""
        if self.pending is None:
            return
        for n, p in self.params.items():
            ref = self.copy[n]
            diff = float((p.detach() - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
            self.rel = max(self.rel, diff)
        if grad_norm is not None:
            self.norm_rel = max(self.norm_rel, abs(grad_norm - self.pending) / self.pending)
        self.pending = None


def check_step(check: FormulaCheck | None, grad_norm: float) -> None:
    """After a train_step: compare that step's update (no-op without a check)."""
    if check is not None:
        check.after_step(grad_norm)
