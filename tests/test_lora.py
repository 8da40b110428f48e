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
from models.lora.targets import target_list

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
    (dict(rank=4, target_modules=["gate"]), {"model_type": "kimi_k2"},
     "'gate': kimi_k2 has no such projection"),   # peft converts nothing on kimi_k2
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


# the tiny MoE models of every LoRA family (transformers 5 classes, as peft sees them)
def _builders():
    from tests.deepseek_v3_tiny import build_deepseek_v3
    from tests.glm4_moe_tiny import build_glm4_moe
    from tests.gpt_oss_tiny import build_gpt_oss
    from tests.kimi_k2_tiny import build_kimi_k2
    from tests.qwen3_5_tiny import build_qwen3_5
    from tools.tiny_models import build_tiny_model

    return {"qwen3_moe": lambda d: build_tiny_model(d, "qwen3_moe", tokenizer=False),
            "mixtral": lambda d: build_tiny_model(d, "mixtral", tokenizer=False),
            "glm4_moe": lambda d: build_glm4_moe(d, tokenizer=False, mtp=False),
            "deepseek_v3": lambda d: build_deepseek_v3(d, tokenizer=False, mtp=False),
            "kimi_k2": build_kimi_k2,
            "gpt_oss": lambda d: build_gpt_oss(d, tokenizer=False),
            "qwen3_5_moe_text": lambda d: build_qwen3_5(d, moe=True, tokenizer=False)}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_moe_models")
    return {name: build(str(root / name)) for name, build in _builders().items()}


def _peft_sites(model) -> dict:
    """{(layer, HF path in the layer): (rank, scaling)} of every adapter peft attached
    (target_parameters as `<module>.<parameter>`, e.g. mlp.experts.gate_up_proj)."""
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        path = name.removeprefix("base_model.model.").replace(".base_layer", "")
        param = getattr(module, "parameter_name", None)
        path += f".{param}" if param else ""
        layer, _, rest = path.removeprefix("model.layers.").partition(".")
        rank = module.lora_A["default"].weight.shape[0] // getattr(module, "num_experts", 1)
        out[(int(layer), rest)] = (rank, module.scaling["default"])
    return out


def _our_sites(hf: dict, spec) -> dict:
    from engine.config.lora_family import layer_paths

    out = {}
    for i in range(hf["num_hidden_layers"]):
        for path, target in layer_paths(hf, i).items():
            key = f"model.layers.{i}.{path}"
            if target in spec.targets:
                out[(i, path)] = (spec.rank_of(key), spec.scaling_of(key))
    return out


# (model.lora.* of the case, families it applies to: None every one)
PEFT_CASES = [(dict(target_modules="all-linear"), None),
              (dict(target_modules=["gate_proj", "up_proj", "down_proj"]), None),
              # (Mixtral and gpt-oss have no down_proj: peft ignores it beside q_proj, model.lora
              # refuses it by name, test_bad_values_are_refused_by_name)
              (dict(target_modules=["down_proj", "q_proj"]),
               {"qwen3_moe", "glm4_moe", "qwen3_5_moe_text"}),
              (dict(target_modules=["down_proj", "q_a_proj"]), {"deepseek_v3", "kimi_k2"}),
              (dict(target_modules=["gate_proj", "up_proj"]), None),
              (dict(target_modules=["gate_proj"]), None),
              (dict(target_modules=["w1", "w3", "w2", "gate"]), {"mixtral"}),
              (dict(target_modules=["k_proj", "gate"]), {"qwen3_moe", "glm4_moe"}),
              (dict(target_modules="all-linear", use_rslora=True), {"qwen3_moe"}),
              (dict(target_modules="all-linear", rank_pattern={"q_proj": 6, "down_proj": 2},
                    alpha_pattern={"o_proj": 3.0, "gate_up_proj": 5.0}), {"qwen3_moe"})]


@pytest.mark.parametrize("family", list(_builders()))
def test_target_names_adapt_what_peft_adapts(moe_models, family):
    """Every MoE family, every way of naming targets: where peft 0.21 (get_peft_model on the
    transformers 5 model) builds adapters, model.lora.* with the same names is accepted and
    resolves (engine.config.lora_family) to adapters of exactly the same modules and
    parameters in every layer, with peft's rank and scaling each (its conversion's 2r / 2
    alpha on gate_up_proj, rsLoRA's alpha / sqrt(r), rank and alpha patterns); where peft
    refuses the names, lora_problems refuses them too. The differences, refused by name
    (test_bad_values_are_refused_by_name): all-linear on a conditional-generation checkpoint,
    and a name the family has no module for, which peft ignores when another name matches."""
    from peft import LoraConfig, get_peft_model

    from engine.config.lora_family import family_spec
    from models.hf.io import read_config
    from tools.tiny_models import load_hf_model

    hf = read_config(moe_models[family])
    for case, families in PEFT_CASES:
        if families is not None and family not in families:
            continue
        names, rslora = case["target_modules"], case.get("use_rslora", False)
        keys = dict(rank=4, alpha=8.0, target_modules=target_list(names), rslora=rslora,
                    rank_pattern=case.get("rank_pattern", {}),
                    alpha_pattern=case.get("alpha_pattern", {}))
        problems = lora_problems(cfg(**keys), hf)
        try:
            model = get_peft_model(load_hf_model(moe_models[family]),
                                   LoraConfig(r=4, lora_alpha=8.0, **case))
        except ValueError as e:   # peft refuses: so must model.lora.*
            assert problems, (family, case, str(e))
            continue
        assert problems == [], (family, case, problems)
        spec = family_spec(hf, 4, 8.0, names, rslora, keys["rank_pattern"],
                           keys["alpha_pattern"])
        theirs, ours = _peft_sites(model), _our_sites(hf, spec)
        assert set(theirs) == set(ours), (family, case, sorted(set(theirs) ^ set(ours)))
        for site, (rank, scaling) in theirs.items():
            assert ours[site][0] == rank and math.isclose(ours[site][1], scaling), \
                (family, case, site, ours[site], (rank, scaling))


def test_families_declare_peft_conversion():
    """Family.lora_fused is peft's own name conversion for the family's model_type on this
    transformers (None where peft converts nothing: Kimi-K2's kimi_k2, Qwen3.5-MoE, gpt-oss):
    a peft that reads names otherwise fails here."""
    import models.hf.config  # noqa: F401  (kimi_k2's registration)
    from peft.utils import transformers_weight_conversion as conversion

    from models.families.registry import FAMILIES

    for model_type, family in FAMILIES.items():
        if not family.lora:
            continue
        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        mapping = conversion._MOE_TARGET_MODULE_MAPPING.get(pattern) \
            if conversion.get_checkpoint_conversion_mapping(model_type) is not None and \
            conversion._MOE_FUSED_TARGETS.get(pattern) else None
        assert family.lora_fused == mapping, (model_type, family.lora_fused, mapping)
