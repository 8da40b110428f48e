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
EXPERTS = {"experts.gate_up_proj", "experts.down_proj"}   # resolved: peft's target_parameters
GATE_UP = r".*\.gate_up_proj"   # the pattern peft's conversion writes


def cfg(grouped=False, **lora):
    return SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(**lora)),
                           moe=SimpleNamespace(grouped_experts=grouped), seed=5)


def test_keys_load_from_the_command_line():
    c = load_config(SFTConfig, ["model.lora.rank=8", "model.lora.alpha=32",
                                "model.lora.target_modules=[q_proj,v_proj]",
                                "model.lora.rslora=true"])[0]
    spec = lora_spec(c, DENSE)
    assert spec.rank == 8 and spec.targets == {"q_proj", "v_proj"} and spec.rslora
    assert math.isclose(spec.scaling, 32 / math.sqrt(8))
    assert lora_spec(load_config(SFTConfig, [])[0], DENSE) is None
    assert lora_build_kwargs(load_config(SFTConfig, [])[0], DENSE) == {}
    c = load_config(SFTConfig, ["model.lora.rank=8", "model.lora.rank_pattern={o_proj:2}",
                                "model.lora.alpha_pattern={o_proj:3.0}"])[0]
    spec = lora_spec(c, DENSE)
    assert spec.rank_of("model.layers.1.self_attn.o_proj") == 2 and spec.rank_of(
        "model.layers.1.self_attn.q_proj") == 8
    assert spec.scaling_of("model.layers.1.self_attn.o_proj") == 1.5


def test_all_linear_is_what_peft_reads_on_the_family():
    """all-linear: the family's projections (Qwen3: attention and MLP); on Qwen3-MoE, as peft
    0.21 converts it for transformers 5's fused experts: the attention, both expert
    parameters (gate_up_proj at rank and alpha x 2) and the router."""
    spec = lora_spec(cfg(rank=4, alpha=8.0), DENSE)
    assert spec.targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"}
    assert spec.scaling == 2.0 and spec.seed == 5 and spec.rank_pattern == {}
    assert lora_problems(cfg(rank=4), DENSE) == []
    assert lora_problems(cfg(), {"model_type": "anything"}) == []   # rank 0: off
    moe = lora_spec(cfg(rank=4, alpha=8.0), MOE)
    assert moe.targets == {"q_proj", "k_proj", "v_proj", "o_proj", "router"} | EXPERTS
    assert moe.rank_pattern == {GATE_UP: 8} and moe.alpha_pattern == {GATE_UP: 16.0}
    assert moe.rank_of("model.layers.1.mlp.experts.gate_up_proj") == 8
    assert moe.rank_of("model.layers.1.mlp.experts.down_proj") == 4
    assert moe.scaling_of("model.layers.1.mlp.experts.gate_up_proj") == 2.0
    mlp = lora_spec(cfg(rank=4, target_modules=["gate_proj", "up_proj", "down_proj"]), MOE)
    assert mlp.targets == EXPERTS and mlp.rank_pattern == {GATE_UP: 8}
    down = lora_spec(cfg(rank=4, target_modules=["down_proj"]), MOE)
    assert down.targets == {"experts.down_proj"} and down.rank_pattern == {}
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 4}
    assert lora_spec(cfg(rank=4, target_modules=["w1", "w3", "gate"]), mixtral).targets == \
        {"experts.gate_up_proj", "router"}


@pytest.mark.parametrize("kwargs, hf, needle", [
    (dict(rank=-1), DENSE, "model.lora.rank=-1 must be an integer >= 0"),
    (dict(rank=4, alpha=0), DENSE, "model.lora.alpha=0 must be a number > 0"),
    (dict(rank=4, dropout=1.0), DENSE, "model.lora.dropout=1.0 must be in [0, 1)"),
    (dict(rank=4, dora=True), DENSE, "model.lora.dora=true (DoRA) is not implemented"),
    (dict(rank=4, target_modules=["qkv"]), DENSE, "['qkv'] not valid; choose from q_proj"),
    (dict(rank=4, target_modules=[]), DENSE, "empty not valid"),
    (dict(rank=4), {"model_type": "no_such_family"}, "not implemented for model_type "
                                                      "'no_such_family'; supported: llama"),
    (dict(rank=4, target_modules=["gate_proj", "down_proj"]), MOE,
     "['gate_proj'] without ['up_proj']: peft 0.21 fuses them"),
    (dict(rank=4, target_modules=["gate_proj"]), {"model_type": "mixtral"},
     "'gate_proj': mixtral has no such projection; its names: q_proj, k_proj, v_proj, o_proj,"),
    (dict(rank=4, target_modules=["router"]), DENSE, "adapts ['router'], but the model has no"),
    (dict(rank=4, rank_pattern={"q_proj(": 2}), DENSE, "key 'q_proj(' is not a regular"),
    (dict(rank=4, rank_pattern={"q_proj": 0}), DENSE, "rank_pattern['q_proj']=0 must be an"),
    (dict(rank=4, rank_pattern={"layers.0.self_attn.q_proj": 2}), DENSE,
     "gives self_attn.q_proj rank 2 in layers [0], 4 in layers [1]: megatron's checkpoint"),
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
    assert any("(the experts, the router) take no dropout" in p for p in problems), problems


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
    # peft's per-module ranks: taken from the adapter when model.lora.rank_pattern is unset
    ({"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 4}}, None),
    ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern['q_proj']='x' must be an integer"),
    # module paths, as peft saves them for tied models: each counts as its projection (the
    # loader then needs every layer's tensors)
    ({"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]},
     None),
    ({"target_modules": ".*q_proj"}, "a regular expression; only 'all-linear' or a list"),
    # peft's target_parameters: the experts' fused parameters and the router's weight
    ({"target_parameters": ["mlp.experts.gate_up_proj"]},
     "adapts ['experts.gate_up_proj', 'q_proj', 'v_proj'] on this model"),
    ({"target_parameters": ["mlp.experts.gate_up", "mlp.gate.bias"]},
     "target_parameters ['mlp.experts.gate_up', 'mlp.gate.bias'], which no adapter here"),
    ({"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                            "mlp.gate.weight"]},
     "adapts ['experts.down_proj', 'experts.gate_up_proj', 'q_proj', 'router', 'v_proj']"),
])
def test_init_from_adapter_config_checks(tmp_path, fields, needle):
    c = cfg(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj"],
            init_from=_adapter(tmp_path, **fields))
    problems = lora_problems(c, MOE)
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
    spec = lora_spec(c, MOE)
    assert spec.targets == {"q_proj", "v_proj"} | EXPERTS
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
