"""The DDP communication keys (engine.config.parallel_settings): validation before any process
group, the null rules, and what reaches megatron's DDP config (engine.training.comm_overlap)."""
from types import SimpleNamespace

import pytest
import torch

from engine.config.parallel_settings import (ParallelConfig, overlap_problems, overlap_settings,
                                             resolved_overlap_problems)
from engine.training.comm_overlap import OverlapSettings, ddp_config
from tests.launch import REPO_ROOT


def _cfg(distributed_optimizer=True, **parallel):
    return SimpleNamespace(parallel=ParallelConfig(**parallel),
                           optim=SimpleNamespace(distributed_optimizer=distributed_optimizer))


def test_null_means_on_with_the_distributed_optimizer_on_cuda_only():
    p = ParallelConfig()
    assert overlap_settings(p, True, cuda=True) == OverlapSettings(True, True, None, True)
    assert overlap_settings(p, True, cuda=False) == OverlapSettings(False, False, None, True)
    assert overlap_settings(p, False, cuda=True) == OverlapSettings(False, False, None, True)


def test_forced_values_win_and_param_gather_pulls_grad_overlap_along():
    forced = ParallelConfig(overlap_grad_reduce=False, overlap_param_gather=False)
    assert overlap_settings(forced, True, cuda=True) == OverlapSettings(False, False)
    on = ParallelConfig(overlap_param_gather=True, ddp_bucket_mb=8.0, grad_reduce_in_fp32=False)
    assert overlap_settings(on, True, cuda=False) == OverlapSettings(True, True, 8.0, False)
    grad_only = ParallelConfig(overlap_grad_reduce=True)
    assert overlap_settings(grad_only, False, cuda=False) == OverlapSettings(True, False)


@pytest.mark.parametrize("parallel, dist_opt, names", [
    (dict(overlap_param_gather=True), False,
     ["parallel.overlap_param_gather", "optim.distributed_optimizer"]),
    (dict(overlap_param_gather=True, overlap_grad_reduce=False), True,
     ["parallel.overlap_param_gather", "parallel.overlap_grad_reduce"]),
    (dict(ddp_bucket_mb=0), True, ["parallel.ddp_bucket_mb"]),
    (dict(ddp_bucket_mb=-4.0), True, ["parallel.ddp_bucket_mb"]),
    (dict(ddp_bucket_mb=16.0, overlap_grad_reduce=False), True,
     ["parallel.ddp_bucket_mb", "parallel.overlap_grad_reduce"]),
])
def test_refusals_name_the_keys(parallel, dist_opt, names):
    (problem,) = overlap_problems(_cfg(dist_opt, **parallel))
    assert all(n in problem for n in names), problem


def test_valid_combinations_pass():
    for parallel in (dict(), dict(overlap_grad_reduce=True, ddp_bucket_mb=40.0),
                     dict(overlap_param_gather=True), dict(grad_reduce_in_fp32=False)):
        assert overlap_problems(_cfg(True, **parallel)) == []


def test_bucket_with_an_overlap_that_resolves_off_on_this_host_is_refused_at_run_time():
    cfg = _cfg(False, ddp_bucket_mb=16.0)   # null + no distributed optimizer -> off anywhere
    (problem,) = resolved_overlap_problems(cfg, cuda=True)
    assert "parallel.ddp_bucket_mb=16.0" in problem
    assert resolved_overlap_problems(_cfg(True, ddp_bucket_mb=16.0), cuda=True) == []


def test_megatron_ddp_config_gets_the_settings():
    s = OverlapSettings(True, True, bucket_mb=1.0, grad_reduce_in_fp32=True)
    cfg = ddp_config(s, True, torch.bfloat16)
    assert (cfg.overlap_grad_reduce, cfg.overlap_param_gather, cfg.use_distributed_optimizer,
            cfg.grad_reduce_in_fp32, cfg.average_in_collective) == (True, True, True, True, False)
    assert cfg.bucket_size == 2 ** 20 // 4          # 1 MiB of fp32 gradients
    bf16 = ddp_config(OverlapSettings(True, False, 1.0, False), False, torch.bfloat16)
    assert bf16.bucket_size == 2 ** 20 // 2 and not bf16.grad_reduce_in_fp32
    assert ddp_config(OverlapSettings(), True, torch.float32).bucket_size is None
    with pytest.raises(ValueError):
        ddp_config(OverlapSettings(True, True), False, torch.float32)


@pytest.mark.parametrize("module, recipe", [("engine.sft", "recipes/sft/qwen3_8b_h100.yaml"),
                                            ("engine.rl", "recipes/rl/qwen3_8b_grpo_h100.yaml")])
def test_cli_exits_2_naming_the_key(module, recipe):
    from tests.launch import run_cli

    proc = run_cli(module, "--config", str(REPO_ROOT / recipe), "--validate",
                   "parallel.overlap_param_gather=true", "optim.distributed_optimizer=false")
    assert proc.returncode == 2
    assert "parallel.overlap_param_gather=true needs optim.distributed_optimizer" in proc.stderr


def test_optimizer_state_of_several_padded_buckets_is_put_back_at_padded_offsets():
    """engine.checkpoint.bucket_padding: megatron's compact world tensor (bucket paddings
    dropped) is re-expanded so that parameter offsets of the padded buffer index it; already
    padded tensors (a fixed megatron) are left alone."""
    from engine.checkpoint.bucket_padding import _expand

    buckets = [SimpleNamespace(numel_unpadded=3), SimpleNamespace(numel_unpadded=2)]
    buffer = SimpleNamespace(buckets=buckets, bucket_indices=[(0, 4), (4, 8)], numel=8)
    opt = SimpleNamespace(buffers=[buffer])
    compact = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    state = {"buckets_coalesced": True,
             0: {torch.float32: {"param": compact, "numel_unpadded": 5,
                                 "exp_avg": torch.arange(8.0)}}}
    out = _expand(opt, state)[0][torch.float32]
    assert out["param"].tolist() == [1, 2, 3, 0, 4, 5, 0, 0]
    assert out["exp_avg"].tolist() == list(range(8)) and out["numel_unpadded"] == 5
    assert _expand(opt, None) is None
