"""Wiring found broken on the first GPU run (H100, one rank): the process-group backends and
the SFT data keys. Both run without a GPU or a process group."""
from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.distributed_c10d import Backend, BackendConfig


def test_gpu_process_groups_take_cpu_tensors_too(monkeypatch):
    """On GPUs the default group (and megatron's groups, which inherit its backends) must
    reduce CPU tensors as well: the engine all-reduces host tensors (loss-normaliser counts,
    report sums, router-loss metrics). With backend "nccl" alone that raised "No backend
    type associated with device type cpu" (seen on an H100, torch 2.11, NCCL 2.28)."""
    from parallel import process_groups as pg

    seen = {}
    monkeypatch.setattr(pg.cpu_runtime, "install", lambda: None)
    monkeypatch.setattr(pg.cpu_runtime, "is_cpu_host", lambda: False)
    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(pg.dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(pg.torch.cuda, "set_device", lambda d: seen.setdefault("device", d))
    monkeypatch.setattr(pg.dist, "init_process_group",
                        lambda backend, timeout: seen.setdefault("backend", backend))
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    assert pg.init_distributed() == (0, 1)
    assert seen["device"] == 0
    assert BackendConfig(Backend(seen["backend"])).get_device_backend_map() == {
        "cpu": "gloo", "cuda": "nccl"}


def test_sft_passes_data_cache_dir_and_workers(monkeypatch, tmp_path):
    """data.cache_dir and data.num_workers reach the dataset loader (they were ignored: the
    rendered cache went to ~/.cache whatever data.cache_dir said)."""
    import engine.sft.training as st
    from engine.config.schema import SFTConfig

    calls = []

    class Dataset:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return SimpleNamespace(tokens=[5, 6], labels=[6, 7], loss_mask=[1, 1], vision=None)

        def describe(self):
            return "stub"

    def load(files, tokenizer, seq_length, truncation, **kwargs):
        calls.append((list(files), kwargs))
        return Dataset()

    monkeypatch.setattr(st, "load_sft_dataset", load)
    monkeypatch.setattr(st.dist, "get_rank", lambda *a: 0)
    cfg = SFTConfig()
    cfg.data.train_files = ["train.jsonl"]
    cfg.data.eval_files = ["eval.jsonl"]
    cfg.train.eval_interval = 1
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.num_workers = 3
    st._load_data(cfg, tokenizer=None, hf_config={"model_type": "qwen3"})   # no vision tower
    want = {"cache_dir": str(tmp_path / "cache"), "num_workers": 3, "images": None}
    assert calls == [(["train.jsonl"], want), (["eval.jsonl"], want)]


def test_ulysses_exchange_uses_all_to_all_for_cuda_tensors(monkeypatch):
    """Ulysses picked its all-to-all by dist.get_backend(group) == "nccl", which the mixed GPU
    backend string no longer equals: CUDA tensors would have taken the gloo fallback (an
    all-gather, cp times the traffic). It now decides by the tensors' device."""
    import torch

    from parallel import ulysses

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    calls = []
    monkeypatch.setattr(ulysses.dist, "all_to_all",
                        lambda out, inp, group=None: calls.append("all_to_all"))
    monkeypatch.setattr(ulysses.dist, "all_gather",
                        lambda out, inp, group=None: calls.append("all_gather"))
    monkeypatch.setattr(ulysses.dist, "get_rank", lambda group=None: 0)
    chunks = [torch.zeros(2, 3).as_subclass(FakeCuda) for _ in range(2)]
    ulysses._exchange(chunks, group=None)
    ulysses._exchange([torch.zeros(2, 3) for _ in range(2)], group=None)
    assert calls == ["all_to_all", "all_gather"]
