"""LoRA keys (engine.config.lora_settings), single process, no process group: every bad value is
refused naming its key and the valid choices; the PEFT adapter checks of model.lora.init_from;
the LoraSpec the keys build (rsLoRA scaling). Exactness across layouts and against peft:
tests/test_lora_layouts.py."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from engine.config.lora_settings import LoraConfig, lora_build_kwargs, lora_problems, lora_spec
from engine.config.schema import SFTConfig, load_config

DENSE = {"model_type": "qwen3", "num_hidden_layers": 2}
MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8}


def cfg(grouped=False, **lora):
    return SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(**lora)),
                           moe=SimpleNamespace(grouped_experts=grouped), seed=5)


def test_keys_load_from_the_command_line():
    c = load_config(SFTConfig, ["model.lora.rank=8", "model.lora.alpha=32",
                                "model.lora.target_modules=[q_proj,v_proj]",
                                "model.lora.rslora=true"])[0]
    spec = lora_spec(c)
    assert spec.rank == 8 and spec.targets == {"q_proj", "v_proj"} and spec.rslora
    assert math.isclose(spec.scaling, 32 / math.sqrt(8))
    assert lora_spec(load_config(SFTConfig, [])[0]) is None
    assert lora_build_kwargs(load_config(SFTConfig, [])[0]) == {}


def test_all_linear_expands_and_plain_scaling():
    spec = lora_spec(cfg(rank=4, alpha=8.0))
    # every projection name of every family; a model adapts those it has (models.lora.sites)
    assert spec.targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                            "out_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                            "kv_b_proj"}
    assert spec.scaling == 2.0 and spec.seed == 5
    assert lora_problems(cfg(rank=4), DENSE) == []
    assert lora_problems(cfg(), {"model_type": "anything"}) == []   # rank 0: off


@pytest.mark.parametrize("kwargs, hf, needle", [
    (dict(rank=-1), DENSE, "model.lora.rank=-1 must be an integer >= 0"),
    (dict(rank=4, alpha=0), DENSE, "model.lora.alpha=0 must be a number > 0"),
    (dict(rank=4, dropout=1.0), DENSE, "model.lora.dropout=1.0 must be in [0, 1)"),
    (dict(rank=4, dora=True), DENSE, "model.lora.dora=true (DoRA) is not implemented"),
    (dict(rank=4, target_modules=["qkv"]), DENSE, "['qkv'] not valid; choose from q_proj"),
    (dict(rank=4, target_modules=[]), DENSE, "empty not valid"),
    (dict(rank=4), {"model_type": "no_such_family"}, "not implemented for model_type "
                                                      "'no_such_family'; supported: llama"),
    (dict(rank=4), {"model_type": "deepseek_v3"}, "on deepseek_v3: with transformers 5, peft"),
    (dict(rank=4, target_modules=["in_proj_qkv"]), DENSE,
     "'in_proj_qkv': qwen3 has no such projection; its names: q_proj"),
    (dict(rank=4), {"model_type": "qwen3_5_moe_text"}, "also adapts mlp.shared_expert_gate"),
    (dict(rank=4), {"model_type": "qwen3_5_text", "_conditional_generation_config":
                    {"model_type": "qwen3_5"}}, "all-linear on a conditional-generation"),
    (dict(rank=4, target_modules=["experts"]), DENSE, "the model has no MoE experts"),
    (dict(rank=0, init_from="/x"), DENSE, "model.lora.init_from=/x: no adapter_config.json with an r"),
    (dict(rank=4, init_from="/nonexistent"), DENSE, "not a PEFT adapter folder"),
])
def test_bad_values_are_refused_by_name(kwargs, hf, needle):
    problems = lora_problems(cfg(**kwargs), hf)
    assert any(needle in p for p in problems), problems


def test_expert_targets_run_on_grouped_and_sequential_experts_without_dropout():
    """Expert adapters join the grouped experts (models.layers.experts.grouped) as well as
    SequentialMLP; dropout on them is refused (peft's target_parameters refuse it too)."""
    assert lora_problems(cfg(grouped=True, rank=4, target_modules=["experts"]), MOE) == []
    assert lora_problems(cfg(rank=4, target_modules=["experts", "q_proj"]), MOE) == []
    problems = lora_problems(cfg(rank=4, dropout=0.1, target_modules=["experts"]), MOE)
    assert any("expert adapters take no dropout" in p for p in problems), problems


def _adapter(tmp_path, **fields):
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 16.0, "use_rslora": False,
            "use_dora": False, "bias": "none", "target_modules": ["q_proj", "v_proj"]}
    base.update(fields)
    (tmp_path / "adapter_config.json").write_text(json.dumps(base))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    return str(tmp_path)


@pytest.mark.parametrize("fields, needle", [
    ({}, None),
    ({"use_dora": True}, "use_dora=True; only False is supported"),
    ({"bias": "all"}, "bias='all'; only 'none' is supported"),
    ({"r": 8}, "has r=8, model.lora.rank=4"),
    ({"lora_alpha": 8}, "has lora_alpha=8, model.lora.alpha=16.0"),
    ({"target_modules": ["q_proj"]}, "model.lora.target_modules ['q_proj', 'v_proj']"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    # module paths, as peft saves them for tied models: each counts as its projection (the
    # loader then needs every layer's tensors)
    ({"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]},
     None),
    ({"target_modules": ".*q_proj"}, "a regular expression; only 'all-linear' or a list"),
    # peft's target_parameters: the experts' two fused parameters, nothing else
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "not routers or one of them alone"),
    ({"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                            "mlp.gate.weight"]}, "not routers or one of them alone"),
    ({"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
     "targets ['experts', 'q_proj', 'v_proj'], model.lora.target_modules ['q_proj', 'v_proj']"),
])
def test_init_from_adapter_config_checks(tmp_path, fields, needle):
    c = cfg(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj"],
            init_from=_adapter(tmp_path, **fields))
    problems = lora_problems(c, DENSE)
    if needle is None:
        assert problems == []
    else:
        assert any(needle in p for p in problems), problems


def test_init_from_fills_the_unset_keys_and_refuses_contradicting_ones(tmp_path):
    """model.lora.init_from alone: rank, alpha, targets (with experts for target_parameters)
    and rsLoRA come from adapter_config.json and the run's config holds them; a key given
    that contradicts the adapter is refused naming both."""
    folder = _adapter(tmp_path, r=8, lora_alpha=32, use_rslora=True,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    c = cfg(init_from=folder)
    assert lora_problems(c, MOE) == []
    lora = c.model.lora
    assert (lora.rank, lora.alpha, lora.rslora) == (8, 32, True)
    assert sorted(lora.target_modules) == ["experts", "q_proj", "v_proj"]
    spec = lora_spec(c)
    assert spec.targets == {"q_proj", "v_proj", "experts"}
    assert math.isclose(spec.scaling, 32 / math.sqrt(8))
    for key, value, needle in (("alpha", 16.0, "lora_alpha=32, model.lora.alpha=16.0"),
                               ("rank", 4, "has r=8, model.lora.rank=4"),
                               ("target_modules", ["q_proj"], "model.lora.target_modules "
                                                              "['q_proj']")):
        problems = lora_problems(cfg(init_from=folder, **{key: value}), MOE)
        assert any(needle in p for p in problems), (key, problems)
    plain = cfg(rank=4)   # no adapter: the defaults
    assert lora_problems(plain, DENSE) == [] and plain.model.lora.alpha == 16.0 \
        and plain.model.lora.target_modules == ["all-linear"] and plain.model.lora.rslora is False


def test_init_from_adapter_with_expert_parameters_is_accepted(tmp_path):
    """An adapter of q/v_proj and peft's target_parameters of the fused experts (in either
    order: peft saves them as a set) starts a run with target_modules [q_proj, v_proj, experts]
    on a MoE model."""
    for order in (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                  ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]):
        c = cfg(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj", "experts"],
                init_from=_adapter(tmp_path, target_parameters=order))
        assert lora_problems(c, MOE) == []
