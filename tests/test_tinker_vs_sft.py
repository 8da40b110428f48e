"""The Tinker service against the engine's own LoRA SFT (docs/tinker.md, "Exactness"): on a
LoRA model of `megatron-sft-engine tinker --backend megatron` (one rank, launched through the
console), three `forward_backward(cross_entropy)` + `optim_step` steps over the same rows equal
three steps of `python -m engine.sft` on Megatron-Core (one rank of the session's rank pool)
started from the service's adapter (model.lora.init_from: the service's starting A and B
written as a PEFT folder by peft itself): per-step loss and gradient norm rel 1e-5, and every
adapter matrix after the third step (the engine's checkpoint exported by `tools/convert.py
mcore-to-hf`) rel 1e-5, ||service - engine|| / ||engine|| per matrix (measured: worst 1.4e-6).
Element-wise the largest gap is 8.6e-6 of the adapter's largest value, held to ADAPTER_TOL =
5e-5: AdamW's update m / sqrt(v) amplifies a gradient's rounding where successive gradients
nearly cancel (the two sides compute the same sums in other orders: micro-batches of 2 rows
against one batch of 4). The service's transformers backend lands at 1.4e-5 of the largest
value; tests/test_tinker_megatron.py holds it to the Megatron backend.

The same step on both sides: the rows of a chat JSONL rendered by the engine's data pipeline
(engine.data.datasets: tokens, next-token labels, 0/1 loss mask), each one Datum
(`target_tokens` the labels, `weights` the mask); Tinker's cross_entropy is the sum of the
weighted token losses, the engine's loss.agg_mode=token-sum; AdamW with the same lr, betas,
eps and weight decay, a constant learning rate (optim.schedule=constant), no clipping
(grad_clip_norm 0, optim.clip_grad=0); every row in every step (train.global_batch_size = the
rows, data.shuffle=false). Negative control: a model of the service trained with its weights
shifted one token (the classic label-shift bug) is far from the engine's losses and adapters.

Second tier (tests/conftest.py SECOND_TIER): one server launch, two rank-pool runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.test_tinker import _state, peft_with_adapter  # noqa: E402
from tests.test_tinker_megatron import launched  # noqa: E402
from tools.tiny_models import build_tiny_model  # noqa: E402

RANK, ALPHA, STEPS, SEQ = 4, 32.0, 3, 64
ADAPTER_TOL = 5e-5   # of the adapter's largest value (module docstring: measured 8.6e-6)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM = dict(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.01,
            grad_clip_norm=0.0)
ROWS = [{"messages": [{"role": "user", "content": f"what is {i} plus {2 * i + 1} ?"},
                      {"role": "assistant", "content": f"it is {3 * i + 1}, of course"}]}
        for i in range(4)]


def _datums(samples, shift: int = 0) -> list:
    """One Datum per engine Sample; `shift` moves the weights that many tokens later (the
    negative control's bug)."""
    out = []
    for s in samples:
        mask = list(s.loss_mask)
        weights = [0] * shift + mask[:len(mask) - shift] if shift else mask
        out.append(types.Datum(model_input=types.ModelInput.from_ints(list(s.tokens)),
                               loss_fn_inputs={"target_tokens": list(s.labels),
                                               "weights": [float(w) for w in weights]}))
    return out


def _adapter(root: Path, path: str) -> dict:
    """The adapter of the state the service saved at `path` (tinker://...)."""
    return _state({"root": root}, path)["adapter"]


def _peft_folder(model_dir: str, adapter: dict, out: Path) -> str:
    """The service's adapter as a PEFT folder that peft itself writes (r RANK, lora_alpha
    ALPHA, TARGETS)."""
    model, _ = peft_with_adapter(model_dir, adapter, TARGETS, RANK, ALPHA)
    model.save_pretrained(str(out))
    return str(out)


def _train_on_service(tc, data) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        norms.append(tc.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"])
    return losses, norms


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    from transformers import AutoTokenizer

    from engine.data.datasets import load_sft_dataset

    root = tmp_path_factory.mktemp("tinker_vs_sft")
    model = build_tiny_model(str(root / "llama"), "llama", hidden=64, layers=2, heads=4,
                             kv_heads=2, intermediate=128, initializer_range=0.2)
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    samples = [s for s in load_sft_dataset(str(data), AutoTokenizer.from_pretrained(model), SEQ,
                                           cache_dir=str(root / "cache"), num_workers=0)]
    assert len(samples) == len(ROWS) and all(sum(s.loss_mask) > 0 for s in samples)
    with launched(model, str(root / "state"), 1, "--backend", "megatron") as server:
        sc = tinker.ServiceClient(base_url=server["url"], api_key="tml-k")
        make = lambda: sc.create_lora_training_client(   # noqa: E731
            base_model="llama", rank=RANK, seed=11, train_unembed=False).result()
        tc, control = make(), make()
        start = _adapter(root, tc.save_state("start").result().path)
        service = _train_on_service(tc, _datums(samples))
        end = _adapter(root, tc.save_state("end").result().path)
        shifted = _train_on_service(control, _datums(samples, shift=1))
        shifted_end = _adapter(root, control.save_state("end").result().path)
    adapter = _peft_folder(model, start, root / "start_adapter")
    ckpt = root / "ckpt"
    proc = pools.script(
        1, "-m", "engine.sft", f"model.hf_path={model}", f"data.train_files=[{data}]",
        f"model.lora.init_from={adapter}", "data.shuffle=false", "data.num_workers=0",
        f"data.cache_dir={root / 'cache_run'}", f"train.global_batch_size={len(ROWS)}",
        "train.micro_batch_size=2", f"train.seq_length={SEQ}", f"train.max_steps={STEPS}",
        "loss.agg_mode=token-sum", f"optim.lr={ADAM['learning_rate']}",
        "optim.schedule=constant", "optim.clip_grad=0",
        f"optim.betas=[{ADAM['beta1']},{ADAM['beta2']}]", f"optim.eps={ADAM['eps']}",
        f"optim.weight_decay={ADAM['weight_decay']}", "logging.progress_bar=false",
        f"logging.dir={root / 'log'}", f"checkpoint.dir={ckpt}",
        f"checkpoint.save_interval={STEPS}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    metrics = [m for m in metrics if "loss" in m and "grad_norm" in m]
    proc = pools.script(1, "tools/convert.py", "mcore-to-hf", "--ckpt",
                        str(ckpt / f"iter_{STEPS:07d}"), "--out", str(root / "exported"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from safetensors.torch import load_file
    exported = load_file(str(root / "exported" / "adapter_model.safetensors"))
    return dict(service=service, shifted=shifted, start=start, end=end, exported=exported,
                shifted_end=shifted_end,
                engine=([m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]))


def test_losses_and_grad_norms_equal_the_engines_lora_sft(runs):
    (losses, norms), (e_losses, e_norms) = runs["service"], runs["engine"]
    assert len(e_losses) == STEPS and len(set(np.round(losses, 6))) == STEPS   # it trains
    assert _rel(losses, e_losses) < 1e-5, (losses, e_losses)
    assert _rel(norms, e_norms) < 1e-5, (norms, e_norms)
    assert _rel(runs["shifted"][0], e_losses) > 1e-2, (runs["shifted"][0], e_losses)


def _peft_key(key: str) -> str:
    """peft's tensor name of the service's adapter key (path.A -> ...path.lora_A.weight)."""
    return f"base_model.model.{key[:-2]}.lora_{key[-1]}.weight"


def _matrix_gaps(ours: dict, exported: dict) -> dict[str, float]:
    """Per adapter matrix, ||ours - exported|| / ||exported|| (Frobenius)."""
    out = {}
    for k in ours:
        theirs = exported[_peft_key(k)]
        out[k] = float((ours[k] - theirs).norm() / theirs.norm())
    return out


def _adapter_gap(ours: dict, exported: dict, scale: float) -> float:
    """max |ours - exported| over every matrix, over `scale`."""
    return max(float((ours[k] - exported[_peft_key(k)])
                     .abs().max()) for k in ours) / scale


def test_adapters_after_three_steps_equal_the_engines_export(runs):
    end, exported = runs["end"], runs["exported"]
    names = {_peft_key(k) for k in end}
    assert names == set(exported) and len(names) == 2 * 7 * 2, sorted(names ^ set(exported))[:6]
    assert all(not torch.equal(end[k], runs["start"][k]) for k in end)   # every A and B trained
    gaps, control = _matrix_gaps(end, exported), _matrix_gaps(runs["shifted_end"], exported)
    scale = max(float(t.abs().max()) for t in exported.values())
    largest = _adapter_gap(end, exported, scale)
    print(f"adapter matrices: worst rel {max(gaps.values()):.3g}, label-shift control "
          f"{max(control.values()):.3g}; largest element gap {largest:.3g} of the adapter's "
          "largest value")
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]
    assert largest < ADAPTER_TOL
    assert max(control.values()) > 1e3 * 1e-5   # the label-shift bug stands out by far more
