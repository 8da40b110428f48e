"""The multi-token-prediction (MTP) layer trained with the model (key model.mtp.enabled;
models.layers.mtp, engine.training.mtp), on the tiny GLM-4.5 of tests/glm4_moe_tiny.py with a
complete MTP layer (mtp="full"), and on the tiny Qwen3.5 dense and MoE models of
tests/qwen3_5_tiny.py with theirs (mtp.* names, zero-centred norms):

- one SFT step equals a plain PyTorch loop written from DeepSeek-V3's formula on transformers'
  modules and the same weights (tests/multirank/mtp_check.py): loss, mtp/loss, mtp/accuracy and
  grad norm within 1e-5, with the trunk attached and detached, and on the tiny DeepSeek-V3
  (MLA with YaRN, tests/deepseek_v3_tiny.py) and the tiny Qwen3.5 dense and MoE models too;
  negative controls (the trunk's state before its final norm, [h; e] for [e; h]; Qwen3.5:
  plain w instead of (1 + w) RMSNorms) are off by > 1e-3;
- detached (RL's setting), every trunk parameter's gradient equals the run without MTP; attached
  it does not (control);
- TP2+SP, PP2 (the MTP block and an embedding copy on the last stage), PP2 x VPP2 (in the last
  virtual stage), CP2, EP2, DP2 packing,
  CP2 x packing and DP2 x GA equal one process (loss, grad norm, mtp/loss, mtp/accuracy and every
  exported parameter, the MTP layer's included, rel 1e-5); negative controls: the next tokens
  rolled inside a CP shard (megatron's in-model roll), a per-micro-batch MTP token mean;
  Qwen3.5 dense at TP2+SP and CP2 the same way;
- GRPO with the MTP layer trained (detached) logs mtp/* and leaves every policy metric as
  without it (the HF rollout backend skips the MTP tensors of each sync);
- the keys are checked before any process group; `python -m engine.sft model.mtp.enabled=true`
  trains, checkpoints and `tools/convert.py mcore-to-hf` exports the trained MTP layer under
  model.layers.{N}.* (its embedding/head copies equal to the exported main tensors).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.glm4_moe_tiny import build_glm4_moe
from tests.launch import result_lines

CHECK = "tests/multirank/glm4_moe_check.py"
TOL = 1e-5
M = "mtp=0.3+modes=token-mean"
SPECS = [f"2,1,0,1,16,sp+{M}", f"1,2,0,1,4,{M}", f"1,2,2,1,4,{M}", f"1,1,0,2,16,{M}", f"1,1,0,1,4,ep=2+{M}",
         f"1,1,0,1,16,packing+{M}", f"1,1,0,2,16,packing+{M}", f"1,1,0,1,4,{M}"]
CONTROLS = [f"1,1,0,2,16,bug=mtproll+{M}", f"1,1,0,1,4,bug=mtpmean+{M}"]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    # 4 layers (MTP layer 4): PP2 x VPP2 gives every virtual stage one
    return build_glm4_moe(str(tmp_path_factory.mktemp("glm_mtp") / "model"), mtp="full",
                          num_hidden_layers=4)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    from tests.deepseek_v3_tiny import build_deepseek_v3
    return build_deepseek_v3(str(tmp_path_factory.mktemp("ds_mtp") / "model"), mtp="full")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from tests.qwen3_5_tiny import build_qwen3_5
    return build_qwen3_5(str(tmp_path_factory.mktemp("qwen_mtp") / "model"), mtp="full")


@pytest.fixture(scope="module")
def qwen_moe_dir(tmp_path_factory) -> str:
    from tests.qwen3_5_tiny import build_qwen3_5
    return build_qwen3_5(str(tmp_path_factory.mktemp("qwen_moe_mtp") / "model"), moe=True,
                         mtp="full")


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory) -> str:
    from tests.qwen3_5_tiny import build_qwen3_5_vl
    return build_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen_vl_mtp") / "model"), mtp="full")


@pytest.fixture(scope="module")
def qwen_vl_moe_dir(tmp_path_factory) -> str:
    from tests.qwen3_5_tiny import build_qwen3_5_vl
    return build_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen_vl_moe_mtp") / "model"),
                            moe=True, mtp="full")


@pytest.mark.parametrize("model,detach", [("glm", False), ("glm", True), ("deepseek", False),
                                          ("qwen", False), ("qwen_moe", False),
                                          ("qwen_vl", False)])
def test_one_step_equals_a_plain_loop(request, model, detach):
    folder = request.getfixturevalue(f"{model}_dir")
    pools = request.getfixturevalue("pools")
    [r] = pools.run(1, "tests.multirank.mtp_check:reference_parity", folder, detach)
    ours, ref = r["ours"], r["ref"]
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert _rel(ours[key], ref[key]) < TOL, (key, ours, ref)
    assert ours["mtp_accuracy"] == ref["mtp_accuracy"]
    zero_centred = model.startswith("qwen")   # Qwen3.5's (1 + w) norms: one more control
    for control in ("prenorm", "swapped") + (("plainnorm",) if zero_centred else ()):
        assert _rel(r[control]["mtp_loss"], ref["mtp_loss"]) > 1e-3, r[control]
    if model == "qwen_vl":   # the MTP layer rotated by 1-D positions, not the trunk's M-RoPE:
        # measured grad norm 7.4e-4 (mtp/loss 2.3e-5) off, the engine 1.5e-7
        assert _rel(r["textpos"]["grad_norm"], ref["grad_norm"]) > 1e-4, r["textpos"]


def test_detached_mtp_leaves_the_trunk_gradient_alone(pools, glm_dir):
    [r] = pools.run(1, "tests.multirank.mtp_check:trunk_gradients", glm_dir)
    assert r["tensors"] > 20 and r["detached"] < 1e-6 and r["attached"] > 1e-2, r
    norms = r["grad_norm"]
    assert _rel(norms["detached"], norms["off"]) < 1e-6 < _rel(norms["attached"], norms["off"])


def _layouts(pools, model_dir: str, ref: str, specs: list[str], env: dict | None = None
             ) -> tuple[list[dict], dict]:
    """(the one-process reference's per-step mtp/* metrics, {spec: result} of the 2-rank
    launch) of the layout harness (CHECK) on `model_dir`."""
    first = pools.script(1, CHECK, model_dir, ref, f"1,1,0,1,16,{M}", env=env, timeout=900)
    [reference] = result_lines(first.stdout)
    steps = reference["moe"]
    assert len(steps) == 3 and all(0 < s["mtp/loss"] for s in steps)
    proc = pools.script(2, CHECK, model_dir, ref, *specs, env=env, timeout=900)
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert sorted(results) == sorted(specs)
    return steps, results


def _assert_equal_to_one_process(result: dict, steps: list[dict]) -> None:
    """loss, grad norm, parameters within TOL; mtp/loss within TOL, mtp/accuracy equal."""
    r = result
    assert r["loss_rel"] < TOL and r["grad_norm_rel"] < TOL and r["param_rel"] < TOL, r
    for got, want in zip(r["moe"], steps):
        assert _rel(got["mtp/loss"], want["mtp/loss"]) < TOL, (r["spec"], got, want)
        assert got["mtp/accuracy"] == want["mtp/accuracy"], (r["spec"], got, want)


def test_layouts_equal_one_process(pools, glm_dir, tmp_path):
    steps, results = _layouts(pools, glm_dir, str(tmp_path / "ref.pt"), SPECS + CONTROLS)
    assert any(s["mtp/accuracy"] > 0 for s in steps)   # the count is exercised
    for spec in SPECS:
        _assert_equal_to_one_process(results[spec], steps)
    for spec in CONTROLS:
        r = results[spec]
        assert r["param_rel"] > 1e-3 or r["grad_norm_rel"] > 1e-3, r


def test_qwen3_5_mtp_layer_maps_under_its_own_names(pools, qwen_moe_dir):
    """The trained Qwen3.5 MTP layer loads from and exports to exactly the stored mtp.* names
    (vLLM's qwen3_5_mtp names), bitwise; nothing passes through."""
    [r] = pools.run(1, "tests.multirank.mtp_check:export_round_trip", qwen_moe_dir)
    assert r["missing"] == r["extra"] == r["passthrough"] == [] and r["max_abs"] == 0.0, r
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                 "mtp.layers.0.self_attn.q_proj.weight",
                 "mtp.layers.0.mlp.experts.3.down_proj.weight",
                 "mtp.layers.0.mlp.shared_expert_gate.weight"):
        assert name in r["mtp"], (name, r["mtp"])


def test_qwen3_5_layouts_equal_one_process(pools, qwen_dir, tmp_path):
    """Qwen3.5's MTP layer (mtp.* names, zero-centred norms, gated attention) at TP2+SP and CP2
    against one process: loss, grad norm, mtp/* and every exported parameter (the mtp.* ones
    included). Adam eps 1e-3 as in tests/test_vlm.py: with the harness's 1e-4, Adam amplifies
    the reduction-order noise of rarely seen embedding rows (TP2+SP measured 1.36e-5 in
    model.embed_tokens.weight, 8.2e-6 in a trunk k_proj, loss 9e-8 and grad norm 4.5e-8
    relative); with 1e-3 every tensor is within 1.2e-6."""
    specs = [f"2,1,0,1,16,sp+{M}", f"1,1,0,2,16,{M}"]
    steps, results = _layouts(pools, qwen_dir, str(tmp_path / "ref.pt"), specs,
                              env={"INV_ADAM_EPS": "1e-3"})
    for spec in specs:
        _assert_equal_to_one_process(results[spec], steps)


def test_qwen3_5_with_images_layouts_equal_one_process(pools, qwen_vl_dir, qwen_vl_moe_dir,
                                                       tmp_path):
    """The published Qwen3.5 shape (a conditional-generation checkpoint with a vision tower,
    models.vision.model.MTPVisionLanguageModel) trained with its MTP layer on batches with
    images (tests/multirank/vision_batches.py, the tower trained): TP2+SP, PP2 (the tower on
    the first stage, the MTP block on the last), CP2, packing, CP2 x packing and, for the MoE
    variant, EP2 equal one process: loss, grad norm, mtp/* and every exported parameter (the
    tower's and the mtp.* ones included). Adam eps 1e-3 as in tests/test_vlm.py."""
    specs = [f"2,1,0,1,16,sp+{M}", f"1,2,0,1,4,{M}", f"1,1,0,2,16,{M}",
             f"1,1,0,1,16,packing+{M}", f"1,1,0,2,16,packing+{M}", f"1,1,0,1,4,moe+ep=2+{M}"]
    env = {"INV_IMAGES": "1", "INV_ADAM_EPS": "1e-3", "INV_MOE_MODEL_DIR": qwen_vl_moe_dir}
    ref = str(tmp_path / "ref.pt")
    first = pools.script(1, CHECK, qwen_vl_dir, ref, f"1,1,0,1,16,{M}",
                         f"1,1,0,1,16,moe+{M}", env=env, timeout=900)
    dense, moe = result_lines(first.stdout)
    control = f"1,1,0,2,16,bug=mtproll+{M}"
    proc = pools.script(2, CHECK, qwen_vl_dir, ref, *specs, control, env=env, timeout=900)
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert sorted(results) == sorted(specs + [control])
    for spec in specs:
        _assert_equal_to_one_process(results[spec], (moe if "moe" in spec else dense)["moe"])
    assert results[control]["param_rel"] > 1e-3, results[control]


def _cfg(**mtp):
    from engine.config.mtp_settings import MTPConfig
    lora = SimpleNamespace(rank=0, init_from=None)
    return SimpleNamespace(model=SimpleNamespace(mtp=MTPConfig(**mtp), lora=lora),
                           parallel=SimpleNamespace(vpp=None),
                           train=SimpleNamespace(loss_chunk_tokens=1024),
                           moe=SimpleNamespace(routing_replay=None))


def test_keys_are_checked_by_name(glm_dir):
    from engine.config.mtp_settings import mtp_problems, mtp_training
    from models.families.base import ORIGINAL
    from models.hf.io import read_config

    cfg = read_config(glm_dir)
    assert mtp_problems(_cfg(), cfg) == [] and mtp_training(_cfg()) is None
    assert mtp_problems(_cfg(enabled=True), cfg) == []
    assert mtp_training(_cfg(enabled=True)).detach is False   # SFT-shaped: attached
    rl = _cfg(enabled=True)
    rl.rollout = SimpleNamespace()
    assert mtp_training(rl).detach is True                     # RL: detached by default
    rl.model.mtp.detach_trunk = False
    assert any("detach_trunk=false is not allowed in RL" in p for p in mtp_problems(rl, cfg))
    none = dict(cfg, num_nextn_predict_layers=0)
    assert any("has no MTP layers" in p for p in mtp_problems(_cfg(enabled=True), none))
    qwen = {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}
    assert mtp_problems(_cfg(enabled=True), qwen) == []
    dedicated = dict(qwen, mtp_use_dedicated_embeddings=True)
    assert any("mtp_use_dedicated_embeddings=true is not supported" in p
               for p in mtp_problems(_cfg(enabled=True), dedicated))
    wrapper = dict(qwen, **{ORIGINAL: {"model_type": "qwen3_5"}})   # a wrapper's text view
    assert mtp_problems(_cfg(enabled=True), wrapper) == []   # trained with its tower
    plain = {"model_type": "qwen3", "num_mtp_layers": 1}
    assert any("not supported for model_type 'qwen3'" in p
               for p in mtp_problems(_cfg(enabled=True), plain))
    bad = _cfg(enabled=True, loss_scale=0)
    bad.train.loss_chunk_tokens = 0
    bad.model.lora.rank = 8
    text = " ".join(mtp_problems(bad, cfg))
    for key in ("model.mtp.loss_scale=0", "LoRA", "train.loss_chunk_tokens"):
        assert key in text, text


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_sft_trains_and_exports_the_mtp_layer(pools, glm_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                          {"role": "assistant", "content": f"w{i + 2} w{i + 3} w{i + 4}"}]}
            for i in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    pools.script(2, "-m", "engine.sft", f"model.hf_path={glm_dir}", f"data.train_files=[{train}]",
                 "model.mtp.enabled=true", "model.mtp.loss_scale=0.5",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=48",
                 "train.max_steps=2", "optim.lr=1e-2", "logging.progress_bar=false",
                 f"logging.dir={run}", f"checkpoint.dir={run / 'ckpt'}",
                 "checkpoint.save_interval=2", timeout=600)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["mtp/loss"] > 0 and 0 <= m["mtp/accuracy"] <= 1 for m in metrics[:2]), metrics
    ckpt = next((run / "ckpt").glob("iter_*"))
    assert json.loads((ckpt / "bridge.json").read_text())["mtp_layers"] == 1
    assert "_mtp_trained" not in json.loads((ckpt / "hf_source" / "config.json").read_text())
    out = tmp_path / "hf"
    pools.script(1, "tools/convert.py", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    before, after = _tensors(Path(glm_dir)), _tensors(out)
    assert sorted(before) == sorted(after)
    changed = [n for n in before if n.startswith("model.layers.4.")
               and not torch.equal(before[n], after[n])]
    assert "model.layers.4.eh_proj.weight" in changed and "model.layers.4.enorm.weight" in changed
    assert torch.equal(after["model.layers.4.embed_tokens.weight"],
                       after["model.embed_tokens.weight"])
    assert torch.equal(after["model.layers.4.shared_head.head.weight"], after["lm_head.weight"])


def _image_rows(root: Path, n: int = 8) -> None:
    """`n` random PNGs under root/imgs (12..20 x 16 pixels: 2-4 image tokens each)."""
    from tests.qwen3_5_tiny import write_png

    (root / "imgs").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        write_png(root / "imgs" / f"{i}.png", 12 + 4 * (i % 3), 16, i)


def test_published_qwen3_5_trains_its_mtp_layer_with_images(pools, qwen_vl_dir, tmp_path):
    """The published Qwen3.5 shape (conditional-generation checkpoint, vision tower, mtp.*)
    through the command lines with images: `engine.sft model.mtp.enabled=true` logs mtp/*,
    checkpoints (bridge.json mtp_layers 1) and `mcore-to-hf` exports every mtp.* tensor trained,
    the frozen tower bitwise and config.json as stored; `engine.rl` (GRPO, HF rollouts, image
    prompts, the MTP layer detached) keeps rollout/logprob_diff < 1e-5 and logs mtp/*."""
    data = tmp_path / "data"
    _image_rows(data)
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": f"imgs/{i}.png"},
                                     {"type": "text", "text": f"what is {i % 4} ?"}]},
        {"role": "assistant", "content": f"it is {i % 4} and {i % 3}"}]} for i in range(8)]
    (data / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "rl.jsonl").write_text("".join(json.dumps(
        {"prompt": f"<image> what is {i} plus 1 ?", "images": [f"imgs/{i}.png"],
         "answer": i + 1}) + "\n" for i in range(8)))
    common = (f"model.hf_path={qwen_vl_dir}", "model.mtp.enabled=true", "train.max_steps=2",
              "train.seq_length=48", "optim.lr=1e-2", "logging.progress_bar=false",
              "data.num_workers=0")
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    pools.script(1, "-m", "engine.sft", *common, f"data.train_files=[{data / 'sft.jsonl'}]",
                 "train.global_batch_size=8", "train.micro_batch_size=2",
                 f"logging.dir={sft}", f"checkpoint.dir={sft / 'ckpt'}",
                 "checkpoint.save_interval=2", f"data.cache_dir={sft / 'cache'}", timeout=600)
    pools.script(1, "-m", "engine.rl", *common, f"data.train_files=[{data / 'rl.jsonl'}]",
                 "reward.fn=tests.test_rl_loop:digit_reward", "rollout.n=2",
                 "rollout.max_new_tokens=6", "train.prompts_per_step=2",
                 "train.micro_batch_size=1", f"logging.dir={rl}",
                 f"data.cache_dir={rl / 'cache'}", timeout=600)
    for run in (sft, rl):
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 2 and all(m["mtp/loss"] > 0 for m in metrics), metrics
    assert all(m["rollout/logprob_diff"] < 1e-5 for m in metrics), metrics
    ckpt = next((sft / "ckpt").glob("iter_*"))
    assert json.loads((ckpt / "bridge.json").read_text())["mtp_layers"] == 1
    out = tmp_path / "hf"
    pools.script(1, "tools/convert.py", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    before, after = _tensors(Path(qwen_vl_dir)), _tensors(out)
    assert sorted(before) == sorted(after)
    mtp = [n for n in before if n.startswith("mtp.")]
    tower = [n for n in before if n.startswith("model.visual.")]
    assert len(mtp) > 10 and all(not torch.equal(before[n], after[n]) for n in mtp)
    assert tower and all(torch.equal(before[n], after[n]) for n in tower)
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((Path(qwen_vl_dir) / "config.json").read_text())


def test_grpo_trains_the_mtp_layer_without_moving_the_policy(pools, glm_dir, tmp_path):
    """GRPO (HF rollouts, DP2) with model.mtp.enabled=true (detached: RL's default) logs
    mtp/loss and mtp/accuracy on the rollouts' tokens, and every policy metric of both steps
    (rollouts, rewards, losses, grad norm) equals the run without MTP: the policy's update is
    its own."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i + 1} ?",
                                           "answer": 2 * i + 1}) + "\n" for i in range(8)))
    runs = {}
    for name, flag in (("off", "false"), ("on", "true")):
        log_dir = tmp_path / name
        pools.script(
            2, "-m", "engine.rl", f"model.hf_path={glm_dir}", f"data.train_files=[{prompts}]",
            f"model.mtp.enabled={flag}", "rollout.n=4", "rollout.max_new_tokens=8",
            "train.prompts_per_step=2", "train.micro_batch_size=2", "train.max_steps=2",
            "train.seq_length=64", "optim.lr=1e-3", "reward.fn=tests.rl_rewards:digit_reward",
            f"logging.dir={log_dir}", f"checkpoint.dir={log_dir / 'ckpt'}",
            "logging.progress_bar=false", timeout=400)
        runs[name] = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["on"]) == len(runs["off"]) == 2
    for off, on in zip(runs["off"], runs["on"]):
        assert on["mtp/loss"] > 0 and 0 <= on["mtp/accuracy"] <= 1, on
        for key in ("reward/mean", "policy/entropy", "grad_norm", "response/length_mean"):
            assert _rel(on[key], off[key]) < 1e-4, (key, on[key], off[key])
        # policy/loss: on-policy (old log-probs from the training forward, ratio exactly 1) it is
        # -mean(advantage), zero up to rounding (-5.2e-8 vs -5.8e-8 on an AVX2 host): judged
        # against the advantages' scale, 1
        assert abs(on["policy/loss"] - off["policy/loss"]) < 1e-6, (on, off)
        # the rollout/trainer log-prob gap is fp32 rounding (~1e-6) in both runs: its size is the
        # check; a relative comparison of two rounding residues is not (1.17e-6 vs 9.8e-7 on a
        # host with AMX)
        assert on["rollout/logprob_diff"] < 1e-5 and off["rollout/logprob_diff"] < 1e-5, on


def test_kto_trains_the_mtp_layer_on_the_desirable_completions(pools, glm_dir):
    """Issue 76 item 3: KTO passed zero per-sequence weights, so `mtp/loss` was 0 and the MTP
    layer got no gradient. Now its targets are the DESIRABLE examples' completion tokens
    (token-mean over them, 0 on the undesirable ones, as DPO trains it on the chosen side): on
    a batch of 5 desirable and 3 undesirable examples `mtp/loss` is logged and > 0 and every
    step moves the MTP layer; on the same examples all undesirable the weights are all 0, so
    `mtp/loss` is 0 (and the one-sided metrics are left out, item 7). A DPO step on the same
    engine logs `mtp/*` too (its chosen completions)."""
    [r] = pools.run(1, "tests.multirank.preference_mtp_check:kto_trains_the_mtp_layer", glm_dir)
    mixed, rejected = r["steps"]
    desirable = sum(c for c, label in zip(mixed["counts"], mixed["labels"]) if label)
    assert mixed["weights"] == pytest.approx(
        [1 / desirable if label else 0.0 for label in mixed["labels"]], rel=1e-12)
    assert 3 < mixed["mtp_loss"] < 10 and mixed["tensors"] > 5, mixed   # ln 200 = 5.3
    assert mixed["moved"] > 1e-3, mixed
    assert "rewards/margins" in mixed["keys"] and "mtp/accuracy" in mixed["keys"]
    assert rejected["weights"] == [0.0] * 8 and rejected["mtp_loss"] == 0.0, rejected
    for key in ("rewards/chosen", "logps/chosen", "logits/chosen", "rewards/margins"):
        assert key not in rejected["keys"], rejected["keys"]
    assert "rewards/rejected" in rejected["keys"]
    dpo = r["dpo"]   # DPO trained it on the chosen completions but did not log mtp/*
    assert 3 < dpo["mtp_loss"] < 10 and dpo["moved"] > 1e-3 and "mtp/accuracy" in dpo["keys"]
