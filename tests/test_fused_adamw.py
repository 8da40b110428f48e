"""optim.fused (engine.training.fused_adamw): torch's fused AdamW switched on inside megatron's
optimizer. Here on plain torch AdamWs wrapped the way megatron wraps them (a chained optimizer
of optimizers holding a torch one): fused on request on the CPU, off by default there (null:
CUDA only), the update within fp32 rounding of foreach AdamW (the measured worst is asserted
and printed), the run's own setting back after a checkpoint load from a run with the other
setting, a refusal by name for a device without the kernel. Megatron's real distributed
optimizer with optim.fused=true against the unfused single process: tests/test_sft_invariance.py
(flag `fused`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.training.fused_adamw import reapply, torch_adams, use_fused


def _megatron_like(params: list[torch.nn.Parameter]):
    adam = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)]), adam


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen))
            for shape in ((64, 32), (32,), (7, 5, 3))]


def _steps(adam, params, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        adam.step()


def test_fused_on_request_within_rounding_of_foreach():
    ref_params, params = _params(), _params()
    ref_wrapper, ref_adam = _megatron_like(ref_params)
    wrapper, adam = _megatron_like(params)
    assert use_fused(ref_wrapper, None) == 0          # null: CUDA only; these are CPU tensors
    assert use_fused(wrapper, True) == 1 and torch_adams(wrapper) == [adam]
    _steps(ref_adam, ref_params, 5)
    _steps(adam, params, 5)
    assert all(g["fused"] for g in adam.param_groups)
    assert not any(g["fused"] for g in ref_adam.param_groups)
    rel = max(((p - r).norm() / r.norm()).item() for p, r in zip(params, ref_params))
    moved = max(((p - q).norm() / q.norm()).item() for p, q in zip(params, _params()))
    print(f"fused vs foreach AdamW after 5 steps: max rel {rel:.2e} (moved {moved:.2e})")
    assert rel <= 1e-6 and moved > 1e-2


@pytest.mark.parametrize("saved,resumed", [(True, False), (False, True)])
def test_a_resumed_run_keeps_its_own_setting(saved, resumed):
    """A checkpoint carries the saving run's param groups (fused flag included); the resumed
    run's setting wins once the load is done (`reapply`, which engine.checkpoint's loader
    calls), with the same step counters; nothing runs per step (no step pre-hook). Negative
    control: without `reapply` the loaded run keeps the saving run's setting."""
    params = _params()
    wrapper, adam = _megatron_like(params)
    use_fused(wrapper, saved)
    _steps(adam, params, 3)
    state = adam.state_dict()
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    wrapper2, adam2 = _megatron_like(params2)
    use_fused(wrapper2, resumed)
    adam2.load_state_dict(state)
    assert all(g["fused"] is saved for g in adam2.param_groups)   # what torch loaded
    for s in adam2.state.values():    # as megatron's loaders leave them: host numbers
        s["step"] = float(s["step"])
    assert not adam2._optimizer_step_pre_hooks
    reapply(wrapper2)
    _steps(adam2, params2, 1, seed=9)
    assert all(g["fused"] is resumed for g in adam2.param_groups)
    assert {float(s["step"]) for s in adam2.state.values()} == {4.0}
    assert all(torch.is_tensor(s["step"]) and s["step"].dtype == torch.float32
               for s in adam2.state.values())
    params3 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    wrapper3, adam3 = _megatron_like(params3)
    use_fused(wrapper3, resumed)
    adam3.load_state_dict(state)     # no reapply: the saving run's setting stays
    _steps(adam3, params3, 1, seed=9)
    assert all(g["fused"] is saved for g in adam3.param_groups)


def test_a_device_without_the_kernel_is_refused_by_name():
    wrapper, _ = _megatron_like([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match=r"optim.fused=true: .* on meta"):
        use_fused(wrapper, True)
    assert use_fused(wrapper, False) == 0


def test_step_counters_follow_the_parameters_device():
    """The device placement a CUDA run needs, on the meta device: fused, a host step counter
    (as megatron's loaders leave it) moves to the parameter's device as fp32; unfused, host
    counters stay on the host (torch's default without capturable/fused; a device counter
    comes back with .cpu(), which a meta tensor cannot show) and plain numbers become
    tensors."""
    from engine.training.fused_adamw import apply_setting

    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    adam = torch.optim.AdamW([p])
    adam.state[p] = {"step": torch.tensor(7.0, dtype=torch.float64)}
    apply_setting(adam, True)
    step = adam.state[p]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    adam.state[p]["step"] = torch.tensor(7.0)
    apply_setting(adam, False)
    step = adam.state[p]["step"]
    assert step.device.type == "cpu" and adam.param_groups[0]["fused"] is False
    adam.state[p]["step"] = 5          # a plain number (older checkpoints)
    apply_setting(adam, False)
    assert torch.is_tensor(adam.state[p]["step"]) and float(adam.state[p]["step"]) == 5.0
