"""engine.generation.vllm.attention's rules, without vLLM: which vllm.LLM arguments select
CPU_MLA (an MLA folder on a CPU host, for the target and for an MLA speculative draft) and
which are left alone (GPUs, models without MLA, a draft folder without MLA, a backend the user
named). vLLM's own selection with these arguments on a simulated AMX CPU, and the backends of a
real engine's layers: tests/test_vllm.py."""
from __future__ import annotations

import json
from pathlib import Path

from engine.generation.vllm.attention import CPU_MLA, cpu_attention_args, uses_mla


def _folder(path: Path, **config) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_mla_folders_get_cpu_mla_on_cpu_only(tmp_path):
    mla = _folder(tmp_path / "ds", model_type="deepseek_v3", kv_lora_rank=512)
    wrapped = _folder(tmp_path / "vl", model_type="kimi_vl",
                      text_config={"model_type": "deepseek_v3", "kv_lora_rank": 512})
    gqa = _folder(tmp_path / "qwen", model_type="qwen3", kv_lora_rank=None)
    assert [uses_mla(p) for p in (mla, wrapped, gqa, str(tmp_path / "none"))] == [
        True, True, False, False]
    given = {"max_model_len": 64}
    assert cpu_attention_args(given, mla, on_cpu=True) == {**given, "attention_backend": CPU_MLA}
    assert given == {"max_model_len": 64}   # not modified
    assert cpu_attention_args(given, wrapped, on_cpu=True)["attention_backend"] == CPU_MLA
    assert cpu_attention_args(given, mla, on_cpu=False) == given   # GPUs: vLLM's choice
    assert cpu_attention_args(given, gqa, on_cpu=True) == given


def test_a_speculative_draft_gets_cpu_mla_when_it_is_mla(tmp_path):
    mla = _folder(tmp_path / "ds", model_type="deepseek_v3", kv_lora_rank=512)
    gqa = _folder(tmp_path / "qwen", model_type="qwen3")
    mtp = {"method": "mtp", "num_speculative_tokens": 1}   # the target's own MTP layers
    out = cpu_attention_args({"speculative_config": mtp}, mla, on_cpu=True)
    assert out["speculative_config"] == {**mtp, "attention_backend": CPU_MLA}
    assert mtp == {"method": "mtp", "num_speculative_tokens": 1}   # not modified
    # a draft folder of its own decides for itself
    small = {"model": gqa, "num_speculative_tokens": 2}
    assert cpu_attention_args({"speculative_config": small}, mla, on_cpu=True)[
        "speculative_config"] == small
    big = {"model": mla, "num_speculative_tokens": 2}
    out = cpu_attention_args({"speculative_config": big}, gqa, on_cpu=True)
    assert "attention_backend" not in out
    assert out["speculative_config"]["attention_backend"] == CPU_MLA


def test_a_backend_the_user_named_is_kept(tmp_path):
    mla = _folder(tmp_path / "ds", model_type="deepseek_v3", kv_lora_rank=512)
    for given in ({"attention_backend": "AMX_MLA"},
                  {"attention_config": {"backend": "AMX_MLA"}},
                  {"speculative_config": {"method": "mtp", "attention_backend": "AMX_MLA"},
                   "attention_backend": "AMX_MLA"}):
        assert cpu_attention_args(given, mla, on_cpu=True) == given
    # attention_config without a backend: the engine's choice goes beside it
    out = cpu_attention_args({"attention_config": {"use_non_causal": False}}, mla, on_cpu=True)
    assert out["attention_backend"] == CPU_MLA
