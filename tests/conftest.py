"""Shared fixtures, built once per test session under pytest's tmp_path_factory: the rank pools
that run the multi-rank cases (`pools`, tests/pool.py), tiny random HF models of the three
supported architectures and their TP1 Megatron checkpoints, the CPU demo's assets.

All models have 8 attention heads, 2 KV heads, 4 layers, hidden size 64. `initializer_range=0.2`
(HF default 0.02) makes logits large enough (std ~1) that a logit parity check at 1e-5 means
something.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.launch import run_python  # noqa: E402
from tests.pool import MAX_RANKS, Pools  # noqa: E402
from tests.tiers import (SECOND_TIER, TIERS, file_seconds, second_tier_shards,  # noqa: E402
                         shard_of_run)
from tests.vllm_forkserver import ENV as VLLM_FORKSERVER, VLLM_FILES  # noqa: E402
from tools.tiny_models import build_tiny_model  # noqa: E402

CONVERT = "tools/convert.py"
INIT_RANGE = 0.2

# arch -> build_tiny_model kwargs (besides the shared shape)
TINY_SPECS: dict[str, dict] = {
    "qwen3": dict(arch="qwen3", tie_word_embeddings=True),
    "llama": dict(arch="llama", tie_word_embeddings=False),
    "qwen2": dict(arch="qwen2", vocab_size=1001, tie_word_embeddings=False),
}
ARCHS = tuple(TINY_SPECS)


def build_arch(out_dir: Path, arch: str, seed: int = 0) -> str:
    """Build the tiny model of `arch` (see TINY_SPECS) with `seed` into `out_dir`."""
    spec = dict(TINY_SPECS[arch])
    return build_tiny_model(str(out_dir), spec.pop("arch"), hidden=64, layers=4, heads=8,
                            kv_heads=2, seed=seed, initializer_range=INIT_RANGE, **spec)


def tier_of_run(config) -> str | None:
    """The tier this run selects: None when it names files or tests (no tiering), else
    TESTS_TIER (default: "default"), refused by name when it is none of TIERS."""
    tests_dir = Path(__file__).parent.resolve()
    if not any(Path(a).resolve() == tests_dir for a in config.args):
        return None
    tier = os.environ.get("TESTS_TIER") or "default"
    if tier not in TIERS:
        raise pytest.UsageError(f"TESTS_TIER={tier!r}: valid tiers are {', '.join(TIERS)}")
    return tier


def pytest_configure(config) -> None:
    """TESTS_TIER and TESTS_SHARD checked once, before collection: a bad value ends the run
    with pytest's one-line usage error naming it."""
    shard_of_run(tier_of_run(config))


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """A tier's run (tier_of_run) does not collect the other tier's files, nor, with
    TESTS_SHARD, the second tier's files outside its shard: their modules are not even imported
    (each xdist worker collects every file it is given: 22 s for all, 15 s for the second
    tier's alone on the 2-core host)."""
    tier = tier_of_run(config)
    if tier not in ("default", "second") or not collection_path.name.startswith("test_"):
        return None
    try:
        relative = collection_path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return None
    if (relative in SECOND_TIER) != (tier == "second"):
        return True
    shard = shard_of_run(tier)
    if shard is not None and relative not in _shard_files(*shard):
        return True
    return None


@functools.lru_cache(maxsize=None)
def _shard_files(k: int, n: int) -> frozenset[str]:
    """The files of shard K of N (computed once per process, not once per collected path)."""
    return frozenset(second_tier_shards(n, file_seconds())[k - 1])


def pytest_collection_modifyitems(session, config, items) -> None:
    """Under pytest-xdist only: the files longest first (FILE_SECONDS; unknown files after the
    known ones, in their order), each file's tests in their own order. A plain run keeps
    pytest's order. (The tier's files alone are collected: pytest_ignore_collect.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    seconds = file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


def workers() -> int:
    """How many pytest-xdist workers share the host (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_collection_finish(session) -> None:
    """Once every test module is imported (torch, megatron-core, transformers, peft, the
    engine): their objects go to the collector's permanent generation (gc.freeze), so the
    collections during the session traverse only what the tests make, as in the pool's ranks
    (tests.pool.freeze_heap). Undone at the session's end."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus) -> None:
    gc.unfreeze()   # an ordinary exit: nanobind reports objects still alive at exit as leaks


@pytest.fixture(scope="session", autouse=True)
def vllm_worker_server(request) -> str | None:
    """The session's server of vLLM worker processes (tests/vllm_forkserver.py): started when
    the session runs a file of VLLM_FILES, unless TESTS_VLLM_FORKSERVER=0; its socket in
    TESTS_VLLM_FORKSERVER for this process and the rank pools started after it (autouse and
    session-scoped: set up before `pools`). None when not started."""
    if os.environ.get(VLLM_FORKSERVER) == "0" or not any(
            item.nodeid.split("::")[0] in VLLM_FILES for item in request.session.items):
        return None
    from tests.launch import _env
    from tests.vllm_forkserver import install_client, start_server

    os.environ[VLLM_FORKSERVER] = start_server(_env())
    install_client()
    return os.environ[VLLM_FORKSERVER]


@pytest.fixture(scope="session")
def pools(tmp_path_factory) -> Pools:
    """The session's persistent rank pools (tests/pool.py): `pools.run(world, "mod:fn", ...)`
    and `pools.script(world, script_or_-m, *argv)` run a case on `world` gloo ranks started
    once per world size, instead of a torchrun launch per case. With several xdist workers
    each has its own pools, the ranks kept started shared out between them."""
    manager = Pools(str(tmp_path_factory.mktemp("rank_pools")),
                    max_ranks=max(8, MAX_RANKS // workers()))
    yield manager
    manager.close()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """{"qwen3": dir, "llama": dir, "qwen2": dir}: HF folders (fp32 safetensors + tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: build_arch(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_dirs) -> str:
    """Qwen3, tied embeddings, vocab 200, q/k norms."""
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs) -> str:
    """Llama, untied embeddings, vocab 200."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model_dirs) -> str:
    """Qwen2, untied, QKV bias, vocab 1001 (not a multiple of 8 x TP)."""
    return tiny_model_dirs["qwen2"]


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The CPU demo's assets, written once per session by `python tools/demo.py assets`
    (a real process, as recipes/cpu_demo.sh runs it): OUT/model, OUT/sft_train.jsonl, OUT/sft_eval.jsonl,
    OUT/rl_prompts.jsonl. Read-only for tests; a test module that adds a file uses a name of
    its own."""
    out = tmp_path_factory.mktemp("demo_assets")
    assert run_python("tools/demo.py", "assets", "--out", str(out)).returncode == 0
    return out


@pytest.fixture(scope="session")
def mcore_ckpt_dirs(tiny_model_dirs, pools, tmp_path_factory) -> dict[str, str]:
    """{arch: Megatron checkpoint dir} written at TP1 by `tools/convert.py hf-to-mcore` (on
    the 1-rank pool)."""
    root = tmp_path_factory.mktemp("tiny_mcore")
    out = {}
    for arch, hf_dir in tiny_model_dirs.items():
        ckpt = root / arch
        proc = pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", hf_dir, "--out", str(ckpt),
                            timeout=600)
        assert proc.returncode == 0, f"hf-to-mcore failed for {arch}"
        out[arch] = str(ckpt)
    return out
