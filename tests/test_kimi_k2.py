"""Kimi-K2 checkpoints as Moonshot publishes them (`kimi_k2`: models.families.deepseek_v3.kimi_k2,
models.families.deepseek_v3.kimi_k2_hf, models.hf.custom_code) on the tiny folders of tests/kimi_k2_tiny.py (Kimi-K2's
config.json layout and values: no expert groups, routed scaling 2.827, YaRN factor 32 with
beta_fast = beta_slow = 1, auto_map to DeepSeek-V3's code; "custom": its tokenizer is the folder's
own code, as Kimi-K2's tiktoken tokenizer is):

- the config reads as transformers' DeepseekV3Config (model_type kimi_k2, Kimi's YaRN betas); the
  fields only the custom code reads (architectures, auto_map) and Kimi-K2-Thinking's INT4
  quantization are refused by name, DeepSeek-V3's rows still apply;
- the `kimi-k2` preset counts what transformers' DeepseekV3ForCausalLM holds (meta device):
  1,026,408,209,408 parameters, 32,861,477,888 active per token;
- the registered KimiK2ForCausalLM gives bitwise the logits of transformers' DeepseekV3ForCausalLM
  on the same weights; control: DeepSeek-V3's YaRN beta_fast (32) moves them by > 1e-3;
- hf-to-mcore -> mcore-to-hf is bitwise (tensors, config.json bytes, the tokenizer and the code
  files); `verify` within 1e-4 of transformers (KimiK2ForCausalLM);
- a tokenizer needs its own code exactly when transformers has no class of its name; such a
  folder is refused at engine.sft and engine.rl start without model.trust_remote_code, naming
  the key; with the key engine.sft trains one step from the folder, its tokenizer class being
  the folder's (control: without the key transformers refuses to load that tokenizer), and
  engine.rl runs one GRPO step with the HF rollout backend (whose tokenizer is the folder's
  code too): rollout/logprob_diff < 1e-3.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.kimi_k2_tiny import build_kimi_k2, with_custom_tokenizer
from tests.test_cli_errors import Case, assert_reported_once, chat_row, launch, write_lines

CONVERT = "tools/convert.py"
PRESET = (1_026_408_209_408, 32_861_477_888)   # kimi-k2: total, active per token


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kimi_k2")
    plain = build_kimi_k2(str(root / "kimi"))
    custom = with_custom_tokenizer(plain, str(root / "custom"))
    return {"kimi": plain, "custom": custom, "model": custom, "tmp": str(root), "train": write_lines(root / "train.jsonl",
                                                   [chat_row(a, 5) for a in range(5, 9)]),
            "prompts": write_lines(root / "prompts.jsonl", [
                {"prompt": f"what is {a} + 1 ?", "answer": str(a + 1)} for a in range(4)])}


def _with_config(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(dst)


def test_config_reads_as_deepseek_v3_and_refuses_by_name(kimi):
    from transformers.models.deepseek_v3 import DeepseekV3Config

    from models.families.registry import family_of, model_presets
    from models.hf.config import config_problems, hf_config_object
    from models.hf.io import read_config

    cfg = read_config(kimi["kimi"])
    assert family_of(cfg).describe() == "kimi_k2 (DeepseekV3ForCausalLM)"
    assert config_problems(cfg) == [] and config_problems(model_presets()["kimi-k2"]) == []
    obj = hf_config_object(cfg)
    assert isinstance(obj, DeepseekV3Config) and obj.model_type == "kimi_k2"
    rope = obj.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["beta_fast"], rope["beta_slow"],
            rope["rope_theta"]) == ("yarn", 32.0, 1.0, 1.0, 50000.0)
    wrong = {"architectures=['KimiForCausalLM']": dict(architectures=["KimiForCausalLM"]),
             "auto_map AutoModelForCausalLM='modeling_kimi.KimiForCausalLM'": dict(
                 auto_map={"AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM"}),
             "quant_method='compressed-tensors' is not supported for kimi_k2": dict(
                 quantization_config={"quant_method": "compressed-tensors"}),
             "moe_layer_freq": dict(moe_layer_freq=2),
             "num_key_value_heads": dict(num_key_value_heads=2)}
    for needle, values in wrong.items():
        assert any(needle in p for p in config_problems(dict(cfg, **values))), needle


def test_preset_counts_equal_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

    from models.families.registry import model_presets
    from models.estimate.counting import stage_parameters
    from models.families.deepseek_v3.kimi_k2_hf import register

    register()
    preset = dict(model_presets()["kimi-k2"])
    counts = stage_parameters(preset, 1, 1)
    assert (counts.total, counts.active) == PRESET
    preset.pop("quantization_config")
    kind = preset.pop("model_type")
    with torch.device("meta"):
        registered = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **preset))
        deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(**preset))
    assert type(registered).__name__ == "KimiK2ForCausalLM"
    for model in (registered, deepseek):
        assert sum(p.numel() for p in model.parameters()) == PRESET[0]


def _logits(model_dir: str, cls=None) -> tuple[torch.Tensor, str]:
    from transformers import AutoModelForCausalLM

    from models.families.deepseek_v3.kimi_k2_hf import register

    register()  # what every engine process has (models.hf.config)
    model = (cls or AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids).logits, type(model).__name__


def test_registered_class_is_deepseek_v3_with_control(kimi, tmp_path):
    from transformers.models.deepseek_v3 import DeepseekV3ForCausalLM

    from engine.generation.hf.backend import HFRolloutEngine

    cfg = json.loads(Path(kimi["kimi"], "config.json").read_text())
    as_v3 = _with_config(kimi["kimi"], tmp_path / "v3", model_type="deepseek_v3")
    v3_betas = _with_config(kimi["kimi"], tmp_path / "betas", rope_scaling=dict(
        cfg["rope_scaling"], beta_fast=32.0))
    ours, name = _logits(kimi["kimi"])
    reference, ref_name = _logits(as_v3, DeepseekV3ForCausalLM)
    control, _ = _logits(v3_betas)
    assert (name, ref_name) == ("KimiK2ForCausalLM", "DeepseekV3ForCausalLM")
    assert torch.equal(ours, reference)
    assert (control - ours).abs().max() > 1e-3
    engine = HFRolloutEngine(kimi["kimi"], dtype=torch.float32)  # the HF rollout backend
    assert type(engine.model).__name__ == "KimiK2ForCausalLM" and engine.eos_token_ids == [3]


def test_convert_round_trip_and_verify(pools, kimi, tmp_path):
    src = Path(kimi["custom"])
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", str(src), "--out", str(ckpt))
    pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    from safetensors.torch import load_file
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    for name in ("config.json", "tokenizer_config.json", "tiktoken.model", "tokenization_kimi.py",
                 "configuration_deepseek.py", "modeling_deepseek.py"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    proc = pools.script(1, CONVERT, "verify", "--hf-dir", str(src), "--ckpt", str(ckpt),
                        "--seq-len", "40")
    line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
    print(line)
    assert "transformers KimiK2ForCausalLM" in proc.stdout
    assert float(line.split("max_abs_diff=")[1].split()[0]) < 1e-4


def test_custom_tokenizer_detection(kimi, tmp_path):
    """As AutoTokenizer decides: auto_map's class is needed only when transformers has no
    class of that name (the legacy list form of auto_map too)."""
    from models.hf.custom_code import code_files, custom_tokenizer

    assert custom_tokenizer(kimi["kimi"]) is None
    assert custom_tokenizer(kimi["custom"]) == "tokenization_kimi.TikTokenTokenizer"
    assert code_files(kimi["custom"]) == ["configuration_deepseek.py", "modeling_deepseek.py",
                                          "tokenization_kimi.py"]
    auto = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    for name, values, want in (
            ("known", dict(tokenizer_class="PreTrainedTokenizerFast", auto_map=auto), None),
            ("legacy", dict(tokenizer_class="XTokenizer", auto_map=["tokenization_x.XTok"]),
             "tokenization_x.XTok"),
            ("unnamed", dict(auto_map=auto), "tokenization_x.XTokenizer")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps(values))
        assert custom_tokenizer(tmp_path / name) == want, name


CASES = [
    Case("sft_custom_tokenizer", ("model.hf_path={custom}",), needles=(
        "model.hf_path={custom}: its tokenizer is the folder's own code "
        "(tokenization_kimi.TikTokenTokenizer", "set model.trust_remote_code=true")),
    Case("rl_custom_tokenizer", ("model.hf_path={custom}",), module="engine.rl", data="prompts",
         needles=("model.hf_path={custom}: its tokenizer is the folder's own code "
                  "(tokenization_kimi.TikTokenTokenizer", "set model.trust_remote_code=true")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_custom_tokenizer_refused_at_start(case, kimi):
    assert_reported_once(launch(case, kimi), case.expected(kimi))


def test_sft_trains_with_the_folders_tokenizer_code(pools, kimi, tmp_path):
    from models.hf.custom_code import load_tokenizer

    with pytest.raises(ValueError, match="trust_remote_code=True"):   # control
        load_tokenizer(kimi["custom"], trust_remote_code=False)
    own, plain = load_tokenizer(kimi["custom"], True), load_tokenizer(kimi["kimi"])
    assert type(own).__name__ == "TikTokenTokenizer"
    text = "what is 7 + 5 ? the answer is 12"
    assert own(text)["input_ids"] == plain(text)["input_ids"]
    log_dir = tmp_path / "log"
    proc = pools.script(1, "-m", "engine.sft", f"model.hf_path={kimi['custom']}",
                        "model.trust_remote_code=true", f"data.train_files=[{kimi['train']}]",
                        "train.seq_length=32", "train.global_batch_size=2",
                        "train.micro_batch_size=1", "train.max_steps=1",
                        "optim.schedule=constant", "logging.progress_bar=false",
                        f"logging.dir={log_dir}", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and 0 < steps[0]["loss"] < 20, steps


def test_rl_grpo_step_with_the_folders_tokenizer_code(pools, kimi, tmp_path):
    from engine.generation.hf.backend import HFRolloutEngine

    with pytest.raises(ValueError, match="trust_remote_code=True"):   # control
        HFRolloutEngine(kimi["custom"], dtype=torch.float32)
    engine = HFRolloutEngine(kimi["custom"], dtype=torch.float32, trust_remote_code=True)
    assert engine.eos_token_ids == [3]   # config, generation config and the folder's tokenizer
    log_dir = tmp_path / "rl_log"
    proc = pools.script(1, "-m", "engine.rl", f"model.hf_path={kimi['custom']}",
                        "model.trust_remote_code=true", f"data.train_files=[{kimi['prompts']}]",
                        "kl.beta=0", "rollout.n=2", "train.prompts_per_step=2",
                        "rollout.max_new_tokens=4", "train.seq_length=32", "train.max_steps=1",
                        "logging.progress_bar=false", f"logging.dir={log_dir}", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m,) = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    print({k: m[k] for k in ("rollout/logprob_diff", "loss") if k in m})
    assert m["rollout/logprob_diff"] < 1e-3, m
