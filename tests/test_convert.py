"""tools/convert.py used as a user would: its command line (`main(argv)`) on the ranks of the
session's rank pool (tests/pool.py) as `python` / `torchrun` would run it, one real process
(the failing `verify`: its exit code), and the refusals in this process (tests.launch.run_main).

- HF -> mcore (TP1, and TP2 under torchrun) -> HF is bitwise: same tensor names, shapes, dtypes
  and values, no padded vocab rows, no lm_head for tied embeddings; the output loads with
  transformers and gives the original's logits.
- `verify` at TP2 x PP2 on 4 ranks reports max_abs_diff below 1e-4, and fails against a
  different model (negative control).
- Bad input exits with code 2 and a message naming the problem (no traceback).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import ARCHS, CONVERT, build_arch
from tests.launch import run_main, run_python


def _tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(d / f)))
    return out


def _assert_bitwise_equal(original: str | Path, converted: str | Path) -> None:
    a, b = _tensors(original), _tensors(converted)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def convert(pools, world: int, *args: str, check: bool = True):
    """`torchrun --nproc_per_node world tools/convert.py args...` on the rank pool."""
    return pools.script(world, CONVERT, *args, timeout=600, check=check)


def convert_in_process(*args: str):
    """`python tools/convert.py args...` for a refusal: main(argv) in this process."""
    from tools.convert import main

    return run_main(main, list(args), label=CONVERT)


def _mcore_to_hf(pools, ckpt: str | Path, out: Path) -> Path:
    proc = convert(pools, 1, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0
    return out


@pytest.fixture(scope="module")
def roundtrip_dirs(pools, mcore_ckpt_dirs, tmp_path_factory) -> dict[str, Path]:
    """{arch: HF folder written by mcore-to-hf from the TP1 checkpoint of that arch}."""
    root = tmp_path_factory.mktemp("roundtrip")
    return {arch: _mcore_to_hf(pools, mcore_ckpt_dirs[arch], root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_is_bitwise(arch, tiny_model_dirs, roundtrip_dirs):
    original, converted = tiny_model_dirs[arch], roundtrip_dirs[arch]
    _assert_bitwise_equal(original, converted)
    cfg = json.loads((Path(original) / "config.json").read_text())
    out = _tensors(converted)
    # no padded vocab rows (qwen2: 1001 rows, megatron holds 1024)
    assert out["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 64)
    assert ("lm_head.weight" in out) == (not cfg["tie_word_embeddings"])
    assert json.loads((converted / "config.json").read_text()) == cfg
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).read_bytes() == (Path(original) / name).read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_loads_in_transformers_with_same_logits(arch, tiny_model_dirs,
                                                         roundtrip_dirs):
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for d in (tiny_model_dirs[arch], roundtrip_dirs[arch]):
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert logits[0].std() > 0.5  # not the near-zero logits of a default 0.02 init
    assert torch.equal(logits[0], logits[1])


def test_tp2_conversion_roundtrip_is_bitwise(pools, qwen2_dir, tmp_path):
    """Qwen2 is the hardest case: QKV bias, and 1001 vocab rows padded to 1024 and split over
    the 2 ranks (rank 1 holds the last 489 real rows and the 23 padded ones)."""
    ckpt = tmp_path / "ckpt_tp2"
    proc = convert(pools, 2, "hf-to-mcore", "--hf-dir", qwen2_dir, "--out", str(ckpt),
                   "--tp", "2")
    assert proc.returncode == 0
    _assert_bitwise_equal(qwen2_dir, _mcore_to_hf(pools, ckpt, tmp_path / "hf"))


_DIFF = re.compile(r"max_abs_diff=([0-9.eE+-]+|nan|inf)")


def test_verify_tp2_pp2_reports_small_diff(pools, qwen2_dir, mcore_ckpt_dirs):
    proc = convert(pools, 4, "verify", "--hf-dir", qwen2_dir,
                   "--ckpt", mcore_ckpt_dirs["qwen2"], "--tp", "2", "--pp", "2")
    assert proc.returncode == 0
    diffs = _DIFF.findall(proc.stdout)
    assert len(diffs) == 1, proc.stdout
    assert float(diffs[0]) < 1e-4


def test_verify_against_a_different_model_fails(mcore_ckpt_dirs, tmp_path):
    """A real `python tools/convert.py` process: the script's own exit code (1) on failure."""
    other = build_arch(tmp_path / "qwen2_seed1", "qwen2", seed=1)
    proc = run_python(CONVERT, "verify", "--hf-dir", other, "--ckpt", mcore_ckpt_dirs["qwen2"],
                      timeout=600)
    assert proc.returncode != 0
    diffs = _DIFF.findall(proc.stdout)
    assert len(diffs) == 1 and float(diffs[0]) > 1e-2, proc.stdout


def _assert_clean_error(proc, *needles: str) -> None:
    """Exit code 2, every needle in stderr, and no Python traceback (in process: no exception
    but SystemExit left main)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-2000:])


def test_hf_to_mcore_missing_hf_dir(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = convert_in_process("hf-to-mcore", "--hf-dir", str(missing),
                              "--out", str(tmp_path / "out"))
    _assert_clean_error(proc, str(missing), "not found")


def test_hf_to_mcore_without_hf_dir_flag(tmp_path):
    proc = convert_in_process("hf-to-mcore", "--out", str(tmp_path / "out"))
    _assert_clean_error(proc, "--hf-dir")


def test_hf_to_mcore_unsupported_architecture(tmp_path):
    """A real (tiny) GPT-2 folder, as a user would pass it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100,
                               n_positions=64, bos_token_id=0, eos_token_id=0)
                    ).save_pretrained(str(gpt2))
    proc = convert_in_process("hf-to-mcore", "--hf-dir", str(gpt2),
                              "--out", str(tmp_path / "out"))
    _assert_clean_error(proc, "'gpt2'", "unsupported")


@pytest.mark.parametrize("kind", ["hf_folder", "missing"])
def test_mcore_to_hf_on_a_non_checkpoint(kind, qwen3_dir, tmp_path):
    ckpt = qwen3_dir if kind == "hf_folder" else str(tmp_path / "no_such_ckpt")
    out = tmp_path / "out"
    proc = convert_in_process("mcore-to-hf", "--ckpt", ckpt, "--out", str(out))
    _assert_clean_error(proc, ckpt, "not a Megatron distributed checkpoint"
                        if kind == "hf_folder" else "not found")
    assert not out.exists()


def test_mcore_to_hf_names_the_iteration_and_refuses_a_full_out(pools, mcore_ckpt_dirs,
                                                                roundtrip_dirs, tmp_path):
    """--ckpt a run's checkpoint directory (iter_* folders, latest_checkpointed_iteration.txt):
    the newest complete iteration is taken and named, --iteration picks another and one the
    run lacks is refused with those it holds; a non-empty --out is refused unless --overwrite,
    which empties it first (a stale shard is gone) and never deletes the checkpoint."""
    import shutil

    arch = ARCHS[0]
    run = tmp_path / "run"
    for it in (2, 3):
        shutil.copytree(mcore_ckpt_dirs[arch], run / f"iter_{it:07d}")
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "model-00001-of-00002.safetensors"
    stale.write_bytes(b"stale")
    _assert_clean_error(convert_in_process("mcore-to-hf", "--ckpt", str(run), "--out", str(out)),
                        "exists and is not empty", "--overwrite")
    _assert_clean_error(convert_in_process("mcore-to-hf", "--ckpt", str(run), "--iteration", "5",
                                           "--out", str(tmp_path / "o5")),
                        "--iteration 5", "holds iterations [2, 3]")
    _assert_clean_error(convert_in_process("mcore-to-hf", "--ckpt", str(tmp_path), "--out",
                                           str(tmp_path), "--overwrite", "--iteration", "3"),
                        "holds no iter_* folders")
    _assert_clean_error(convert_in_process("mcore-to-hf", "--ckpt", str(run), "--out", str(run),
                                           "--overwrite"), "holds the checkpoint")
    assert (run / "iter_0000003").is_dir()
    proc = convert(pools, 1, "mcore-to-hf", "--ckpt", str(run), "--out", str(out), "--overwrite")
    assert proc.returncode == 0 and "iteration 3 (the newest complete" in proc.stdout
    assert not stale.exists()
    _assert_bitwise_equal(roundtrip_dirs[arch], out)
    proc = convert(pools, 1, "mcore-to-hf", "--ckpt", str(run), "--iteration", "2", "--out",
                   str(tmp_path / "o2"))
    assert proc.returncode == 0 and "iteration 2 (--iteration" in proc.stdout
