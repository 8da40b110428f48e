"""ParallelLayout: dp derivation, one message per violated constraint naming the config key,
no messages for valid layouts, and `validate` raising with every problem listed."""
from __future__ import annotations

import pytest

from parallel.layout import LayoutError, ParallelLayout


@pytest.mark.parametrize("world,tp,pp,cp,dp", [
    (1, 1, 1, 1, 1), (4, 1, 1, 1, 4), (8, 2, 2, 1, 2), (8, 2, 2, 2, 1), (16, 2, 1, 2, 4),
    (4, 1, 4, 1, 1),
])
def test_dp_is_world_over_model_parallel(world, tp, pp, cp, dp):
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp)
    assert layout.dp == dp
    assert layout.model_parallel_size == tp * pp * cp
    assert layout.dp * layout.model_parallel_size == world


# (layout kwargs, model dims, substrings every problem message must contain)
VIOLATIONS = [
    (dict(world_size=4, tp=0), {}, ["parallel.tp"]),
    (dict(world_size=4, pp=-1), {}, ["parallel.pp"]),
    (dict(world_size=4, cp=0), {}, ["parallel.cp"]),
    (dict(world_size=4, tp=1.5), {}, ["parallel.tp"]),
    (dict(world_size=4, pp=2, vpp=0), {}, ["parallel.vpp"]),
    (dict(world_size=6, tp=4), {}, ["parallel.tp", "parallel.pp", "parallel.cp", "6"]),
    (dict(world_size=4, vpp=2), {}, ["parallel.vpp", "parallel.pp"]),
    (dict(world_size=4, pp=4), dict(num_layers=6), ["parallel.pp", "num_hidden_layers=6"]),
    (dict(world_size=4, pp=2, vpp=4), dict(num_layers=4), ["parallel.pp", "parallel.vpp"]),
    (dict(world_size=16, tp=4, cp=4), dict(num_heads=8), ["parallel.tp", "parallel.cp",
                                                          "num_attention_heads=8"]),
    (dict(world_size=4, tp=4), dict(num_kv_heads=2), ["parallel.tp", "num_key_value_heads=2"]),
    (dict(world_size=4, cp=4), dict(seq_length=12), ["parallel.cp", "seq_length=12"]),
]


@pytest.mark.parametrize("kwargs,dims,keys", VIOLATIONS)
def test_each_violation_names_its_key(kwargs, dims, keys):
    problems = ParallelLayout(**kwargs).problems(**dims)
    assert len(problems) == 1, problems
    for key in keys:
        assert key in problems[0], (key, problems[0])


def test_world_size_message_lists_valid_products():
    (msg,) = ParallelLayout(6, tp=4).problems()
    assert "[1, 2, 3, 6]" in msg


def test_all_problems_reported_together():
    layout = ParallelLayout(8, tp=4, pp=2)  # valid sizes, wrong for this model
    problems = layout.problems(num_layers=3, num_heads=6, num_kv_heads=2)
    assert len(problems) == 3
    assert any("num_hidden_layers=3" in p for p in problems)
    assert any("num_attention_heads=6" in p for p in problems)
    assert any("num_key_value_heads=2" in p for p in problems)


@pytest.mark.parametrize("kwargs,dims", [
    (dict(world_size=1), dict(num_layers=4, num_heads=8, num_kv_heads=2, seq_length=7)),
    (dict(world_size=4, tp=2, pp=2), dict(num_layers=4, num_heads=8, num_kv_heads=2)),
    (dict(world_size=4, pp=4), dict(num_layers=4, num_heads=8, num_kv_heads=2)),
    (dict(world_size=8, tp=2, pp=2, cp=2), dict(num_layers=4, num_heads=8, num_kv_heads=2,
                                                 seq_length=16)),
    (dict(world_size=8, pp=2, vpp=2), dict(num_layers=4, num_heads=8, num_kv_heads=2)),
    (dict(world_size=8, cp=4), dict(num_heads=8, num_kv_heads=2, seq_length=24)),
    (dict(world_size=4, pp=2, vpp=1), dict(num_layers=2)),
])
def test_valid_layouts_have_no_problems(kwargs, dims):
    layout = ParallelLayout(**kwargs)
    assert layout.problems(**dims) == []
    assert layout.validate(**dims) is layout


def test_validate_raises_with_every_problem():
    with pytest.raises(LayoutError) as info:
        ParallelLayout(4, tp=4).validate(num_heads=6, num_kv_heads=2)
    text = str(info.value)
    assert "num_attention_heads=6" in text and "num_key_value_heads=2" in text
    assert isinstance(info.value, ValueError)
