"""`--validate` for the distillation and PPO recipes: the teacher (from distill.teacher_path's
config.json, or reported as not counted) and the PPO critic (a second copy of the policy's
trainable state plus the value head) appear as their own lines of the memory estimate and
add exactly their bytes per GPU."""
import json
import re
from pathlib import Path

import pytest

from models.estimate.training_memory import GIB

from engine.config.loading import load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.config import RLConfig
from engine.rl.recipe_check import rl_memory, rl_validate_main
from models.estimate.counting import padded_vocab_size, stage_parameters
from models.families.presets import MODEL_SHAPES

RL = Path(__file__).resolve().parents[1] / "recipes" / "rl"
DISTILL = RL / "qwen3_1_7b_distill_qwen3_8b_h100.yaml"
PPO = RL / "qwen3_8b_ppo_h100.yaml"


def _cfg(path, *overrides) -> RLConfig:
    argv = ["--config", str(path), *overrides]
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def _validate(capsys, path, *args) -> tuple[int, str, str]:
    rc = rl_validate_main(["--config", str(path), "--validate", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _gib(out: str, label: str) -> float:
    """The number after `label` in the training-phase line."""
    line = next(l for l in out.splitlines() if l.startswith("memory per GPU while training"))
    return float(re.search(re.escape(label) + r" ([0-9.]+)", line).group(1))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A directory with Qwen3-8B's public config.json only (what --validate reads)."""
    path = tmp_path_factory.mktemp("qwen3_8b")
    (path / "config.json").write_text(json.dumps(MODEL_SHAPES["qwen3-8b"]))
    return path


def test_recipes_select_their_algorithms():
    distill, ppo = _cfg(DISTILL), _cfg(PPO)
    assert distill.distill.teacher_path and distill.reward.fn == "none"
    assert distill.model.shape == "qwen3-1.7b" and distill.kl.beta == 0.0
    assert (distill.recipe.nodes, distill.recipe.gpus_per_node) == (1, 8)
    assert ppo.algorithm == "ppo" and ppo.advantage.estimator == "gae"
    assert ppo.critic.hf_path is None and ppo.model.shape == "qwen3-8b"
    assert (ppo.recipe.nodes, ppo.recipe.gpus_per_node) == (2, 8)


@pytest.mark.parametrize("path,nodes", [(DISTILL, 1), (PPO, 2), (PPO, 4), (PPO, 8)],
                         ids=["distill-1", "ppo-2", "ppo-4", "ppo-8"])
def test_recipe_validates(path, nodes, capsys):
    rc, out, err = _validate(capsys, path, "--nodes", str(nodes))
    assert rc == 0, err
    assert f"recipe OK on {nodes} node(s) x 8 GPUs" in out and "warning" not in out
    if path == PPO:
        assert "PPO critic per GPU (estimate, GiB): weights 3.8 + grads 7.0" in out
        assert "+ PPO critic" in out and "distillation teacher" not in out
    else:  # no Qwen3-8B weights here: the teacher is reported as not counted
        assert ("distillation teacher: NOT counted in the memory estimate "
                "(distill.teacher_path=/models/Qwen3-8B is not on this machine") in out
        assert "PPO critic" not in out and "+ distillation teacher" not in out


def test_teacher_is_counted_from_its_config(teacher_dir, capsys):
    """With the teacher's config.json readable: its own line, its weights (Qwen3-8B's whole
    model at TP1 in bf16) added to the training peak, and recipe.expected_memory_gib (which
    includes the teacher) is compared and holds."""
    absent = _validate(capsys, DISTILL)[1]
    rc, out, err = _validate(capsys, DISTILL, f"distill.teacher_path={teacher_dir}")
    assert rc == 0, err
    weights = stage_parameters(MODEL_SHAPES["qwen3-8b"], 1, 1).total * 2 / GIB
    assert f"distillation teacher per GPU (estimate, GiB): weights {weights:.1f}" in out
    assert _gib(out, "+ distillation teacher") == pytest.approx(weights, abs=0.05)
    total = lambda text: float(re.search(r"= ([0-9.]+)\n", text).group(1))
    assert total(out) == pytest.approx(total(absent) + weights, abs=0.1)
    # at TP2 every GPU holds half the teacher
    out2 = _validate(capsys, DISTILL, f"distill.teacher_path={teacher_dir}", "parallel.tp=2",
                     "recipe.expected_memory_gib=null")[1]
    half = stage_parameters(MODEL_SHAPES["qwen3-8b"], 2, 1).first_stage * 2 / GIB
    assert _gib(out2, "+ distillation teacher") == pytest.approx(half, abs=0.05)


def test_offloaded_teacher_counts_only_in_its_forward_pass(teacher_dir, capsys):
    """distill.offload=true: the teacher leaves the training line and the resident state;
    its forward pass is a phase of its own (resident training state + teacher weights), and
    the peak is the largest phase (here the training phase, 8B teacher at TP1 < the policy's
    activations + grads)."""
    counted = _validate(capsys, DISTILL, f"distill.teacher_path={teacher_dir}",
                        "recipe.expected_memory_gib=null")[1]
    rc, out, err = _validate(capsys, DISTILL, f"distill.teacher_path={teacher_dir}",
                             "distill.offload=true", "recipe.expected_memory_gib=null")
    assert rc == 0, err
    weights = stage_parameters(MODEL_SHAPES["qwen3-8b"], 1, 1).total * 2 / GIB
    training = lambda text: float(re.search(r"memory per GPU while training .*= ([0-9.]+)\n",
                                            text).group(1))
    resident = lambda text: float(re.search(r"resident training state ([0-9.]+) \+ engine",
                                            text).group(1))
    assert "+ distillation teacher" not in out.split("memory per GPU while training")[1]
    assert training(out) == pytest.approx(training(counted) - weights, abs=0.1)
    assert resident(out) == pytest.approx(resident(counted) - weights, abs=0.1)
    stage = re.search(r"resident training state ([0-9.]+) \+ teacher ([0-9.]+) = ([0-9.]+)",
                      out)
    assert stage and float(stage.group(2)) == pytest.approx(weights, abs=0.05)
    assert float(stage.group(1)) == pytest.approx(resident(out), abs=0.05)


def test_expected_memory_is_compared_only_with_the_teacher_counted(teacher_dir, capsys):
    assert _validate(capsys, DISTILL, "recipe.expected_memory_gib=30")[0] == 0
    rc, _, err = _validate(capsys, DISTILL, "recipe.expected_memory_gib=30",
                           f"distill.teacher_path={teacher_dir}")
    assert rc == 2 and "recipe.expected_memory_gib=30.0 but the estimated peak is 63.1" in err


def test_unreadable_teacher_is_a_problem(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    rc, _, err = _validate(capsys, DISTILL, f"distill.teacher_path={tmp_path}")
    assert rc == 2 and f"distill.teacher_path={tmp_path}" in err and "not valid JSON" in err


def test_teacher_layout_is_checked(tmp_path, capsys):
    """The teacher runs at the policy's layout: TP must divide its heads too."""
    (tmp_path / "config.json").write_text(json.dumps(
        {**MODEL_SHAPES["qwen3-8b"], "num_attention_heads": 6, "num_key_value_heads": 6,
         "head_dim": 128}))
    rc, _, err = _validate(capsys, DISTILL, f"distill.teacher_path={tmp_path}", "parallel.tp=4",
                           "rollout.num_engines=2", "rollout.gpus_per_engine=4")
    assert rc == 2 and f"distill.teacher_path={tmp_path}: " in err


def _critic_gib(hf: dict, tp: int, dp: int) -> float:
    """The critic at TP tp x DP dp (pp 1, distributed optimizer, bf16): every parameter of
    the policy's stage in bf16 plus a value head of h/tp + 1; fp32 gradients and 12 bytes of
    optimizer state / dp for all but the frozen (untied) output layer."""
    n = stage_parameters(hf, tp, 1).last_stage + hf["hidden_size"] // tp + 1
    trained = n - padded_vocab_size(hf["vocab_size"], tp) * hf["hidden_size"] // tp
    return (n * 2 + trained * 4 + trained * 12 / dp) / GIB


@pytest.mark.parametrize("nodes", [2, 4])
def test_ppo_exceeds_grpo_by_the_critic(nodes):
    """Same recipe, algorithm=grpo vs ppo: both phases grow by the critic's weights, gradients
    and optimizer state per GPU, nothing else."""
    world = 8 * nodes
    ppo, grpo = _cfg(PPO), _cfg(PPO, "algorithm=grpo", "advantage.estimator=grpo")
    hf = MODEL_SHAPES["qwen3-8b"]
    (t_ppo, r_ppo, lines), (t_grpo, r_grpo, _) = rl_memory(ppo, hf, world), rl_memory(grpo, hf,
                                                                                       world)
    critic = _critic_gib(hf, ppo.parallel.tp, world // ppo.parallel.tp)
    assert t_ppo - t_grpo == pytest.approx(critic, rel=1e-9)
    assert r_ppo - r_grpo == pytest.approx(critic, rel=1e-9)
    assert any(l.startswith("PPO critic per GPU (estimate, GiB):") and f"= {critic:.1f}" in l
               for l in lines)


def test_ppo_critic_on_the_first_stage_and_tied_embeddings():
    """PP2: the peak stage of this recipe is the first (activations); the critic there has no
    head and no frozen output layer. Tied embeddings (Qwen3-1.7B): nothing is frozen."""
    grpo = _cfg(PPO, "algorithm=grpo", "advantage.estimator=grpo", "parallel.tp=2",
                "parallel.pp=2")
    ppo = _cfg(PPO, "parallel.tp=2", "parallel.pp=2")
    hf = MODEL_SHAPES["qwen3-8b"]
    first = stage_parameters(hf, 2, 2).first_stage
    extra = rl_memory(ppo, hf, 16)[0] - rl_memory(grpo, hf, 16)[0]
    assert extra == pytest.approx((first * 2 + first * 4 + first * 12 / 4) / GIB, rel=1e-9)
    small = MODEL_SHAPES["qwen3-1.7b"]
    tied_ppo = _cfg(PPO, "model.shape=qwen3-1.7b")
    tied_grpo = _cfg(PPO, "model.shape=qwen3-1.7b", "algorithm=grpo",
                     "advantage.estimator=grpo")
    n = stage_parameters(small, 4, 1).last_stage + small["hidden_size"] // 4 + 1
    extra = rl_memory(tied_ppo, small, 16)[0] - rl_memory(tied_grpo, small, 16)[0]
    assert extra == pytest.approx((n * 2 + n * 4 + n * 12 / 4) / GIB, rel=1e-9)


def test_validate_checks_the_critic_keys(capsys):
    """engine.rl.checks.ppo_problems runs in --validate too: a critic.hf_path must be readable
    there (like model.hf_path), the ranges are checked."""
    rc, _, err = _validate(capsys, PPO, "critic.hf_path=/models/critic", "critic.value_clip=0")
    assert rc == 2 and "critic.hf_path=/models/critic: HF model directory not found" in err
    assert "critic.value_clip=0.0 must be > 0" in err
