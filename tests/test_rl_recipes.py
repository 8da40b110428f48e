"""The H100 GRPO/DAPO recipes parse against the RL schema and get the algorithm's defaults."""
from pathlib import Path

import pytest

from engine.config.schema import load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.config import RLConfig

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes", "rl").glob("*.yaml"))


DENSE = [p for p in RECIPES if p.name.startswith("qwen3_8b_")]
AGENT = RECIPES[0].parent / "qwen3_8b_agent_grpo_h100.yaml"
MOE = Path(__file__).resolve().parents[1] / "recipes" / "rl" / "qwen3_30b_a3b_grpo_h100.yaml"


def test_every_recipe_exists():
    assert {p.name for p in RECIPES} == {"qwen3_8b_grpo_h100.yaml", "qwen3_8b_dapo_h100.yaml",
                                         "qwen3_8b_grpo_vllm_h100.yaml",
                                         "qwen3_30b_a3b_grpo_h100.yaml",
                                         "qwen3_30b_a3b_lora_grpo_h100.yaml",
                                         "qwen3_30b_a3b_dapo_gspo_r2_h100.yaml",
                                         "qwen3_8b_tools_grpo_h100.yaml",
                                         "qwen3_8b_agent_grpo_h100.yaml",
                                         "qwen3_8b_ppo_h100.yaml",
                                         "qwen3_1_7b_distill_qwen3_8b_h100.yaml",
                                         "gpt_oss_20b_grpo_h100.yaml",
                                         "moonlight_16b_a3b_grpo_h100.yaml",
                                         "qwen3_5_35b_a3b_grpo_h100.yaml",
                                         "qwen3_5_35b_a3b_lora_grpo_h100.yaml",
                                         "deepseek_v3_grpo_h200.yaml",
                                         "qwen3_vl_8b_grpo_h100.yaml",
                                         "qwen3_8b_grpo_rm_h100.yaml"}


def test_reward_model_recipe_counts_the_reward_model(tmp_path, capsys):
    """GRPO against a Qwen3-8B RM: with the RM's config.json on this machine, its frozen bf16
    weights at TP2 (7.6 GiB) join the rollout phase (reward.model.offload), whose peak is the
    recipe's expected 70.2 GiB; without it, the report says the RM is not counted."""
    import json

    from engine.config.recipe_validation import MODEL_SHAPES
    from engine.rl.recipe_check import rl_validate_main

    config = dict(MODEL_SHAPES["qwen3-8b"], architectures=["Qwen3ForSequenceClassification"],
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = str(RECIPES[0].parent / "qwen3_8b_grpo_rm_h100.yaml")
    assert rl_validate_main(["--config", recipe, "--validate",
                             f"reward.model.path={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "reward model per GPU (estimate, GiB): weights 7.6" in out
    assert "+ reward model 7.6 (reward.model.offload: on the GPU while it scores) = 70.2" in out
    assert rl_validate_main(["--config", recipe, "--validate"]) == 0
    assert "NOT counted" in capsys.readouterr().out


def test_tools_recipe_runs_multi_turn_episodes_with_the_calculator():
    """The Qwen3 tool recipe: env.fn=tools with the example calculator (its schema loads), the
    episode bound (seq_length) holds max_turns turns, Qwen3's template format is hermes."""
    from engine.rl.checks import env_problems
    from engine.data.tool_calls import detect_format
    from engine.rl.env.tool_schema import load_tools
    from tools.char_tokenizer import QWEN3

    argv = ["--config", str(DENSE[-1].parent / "qwen3_8b_tools_grpo_h100.yaml")]
    cfg, _ = load_config(RLConfig, argv)
    assert cfg.env.fn == "tools" and env_problems(cfg) == []
    assert list(load_tools(list(cfg.env.tools))) == ["calculate"]
    assert cfg.env.kwargs["tool_timeout_s"] < cfg.env.step_timeout_s
    assert cfg.train.seq_length >= 4 * cfg.rollout.max_new_tokens
    assert detect_format(QWEN3) == "hermes"


def test_agent_recipe_validates_with_the_vllm_engines_counted(capsys):
    """The agent recipe (docs/agents.md): env.agent is the shipped example scaffold (importable,
    env.fn unset: no env problem), two calls fit the episode bound and vLLM's max_model_len,
    and --validate counts vLLM's share of the GPU beside the resident training state (the
    placement and sync bytes: test_validate_prints_placement_and_sync_bytes)."""
    from engine.rl.checks import env_problems
    from engine.rl.recipe_check import rl_validate_main
    from tools.example_agent import ATTEMPTS, math_retry

    argv = ["--config", str(AGENT)]
    cfg = apply_algorithm_defaults(load_config(RLConfig, argv)[0], explicit_keys(argv))
    assert cfg.env.agent == "tools.example_agent:math_retry" and callable(math_retry)
    assert cfg.env.fn is None and env_problems(cfg) == [] and cfg.env.max_turns == ATTEMPTS
    assert cfg.train.seq_length >= ATTEMPTS * cfg.rollout.max_new_tokens + 1024
    assert cfg.rollout.vllm.max_model_len == cfg.train.seq_length + 1
    assert rl_validate_main(argv + ["--validate"]) == 0
    out = capsys.readouterr().out
    assert "+ KL reference 7.6 = 60.8" in out
    assert "resident training state 40.2 + engine 27.9 (vLLM 0.35 x 79.6) = 68.1" in out
    assert "recipe OK on 2 node(s) x 8 GPUs" in out


class _ScriptedClient:
    """Stands in for the OpenAI client: replies from a script, records the messages sent."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []
        self.chat = self.completions = self

    def create(self, model, messages):
        from types import SimpleNamespace

        self.sent.append([dict(m) for m in messages])
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


@pytest.mark.parametrize("replies, reward, calls", [
    (["7"], 1.0, 1), ([" 7 "], 1.0, 1), (["6", "7"], 0.5, 2), (["6", "8"], 0.0, 2),
    # nothing but the sum's digits counts: no format, repetition or empty reply earns anything
    (["7 7", "the answer is 7"], 0.0, 2), (["7 ?", ""], 0.0, 2), (["77", "07"], 0.0, 2)])
def test_demo_scaffold_rewards_only_the_exact_sum(monkeypatch, replies, reward, calls):
    """recipes/agent_cpu_demo.sh's scaffold (tools.example_agent.retry): 1.0 right first time,
    0.5 right after the feedback, else 0; the second call's messages are the first plus the
    reply and the feedback (so the run extends one trajectory)."""
    import tools.example_agent as agent

    client = _ScriptedClient(replies)
    monkeypatch.setattr(agent, "client_for", lambda base_url: client)
    row = {"prompt": "what is 3 plus 4 ?", "answer": 7}
    out = agent.retry("http://unused/v1", row)
    assert out["reward"] == reward and len(client.sent) == calls
    assert out["metrics"] == {"first_try": float(reward == 1.0),
                              "second_try": float(reward == 0.5)}
    if calls == 2:
        assert client.sent[1] == client.sent[0] + [
            {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": agent.DEMO_FEEDBACK}]


def test_recipe_scaffold_checks_the_final_answer_and_demo_feedback_is_in_vocabulary(
        monkeypatch):
    """math_retry (the H100 recipe's) checks the last \\boxed{} with the math reward; the CPU
    demo's feedback is made of the tiny tokenizer's words (none reads as <unk>)."""
    import tools.example_agent as agent
    from tools.tiny_models import BASE_WORDS

    client = _ScriptedClient(["so \\boxed{6}", "the mistake: \\boxed{7}"])
    monkeypatch.setattr(agent, "client_for", lambda base_url: client)
    out = agent.math_retry("http://unused/v1", {"prompt": "3 + 4?", "answer": "7"})
    assert out["reward"] == 0.5 and client.sent[1][-1]["content"] == agent.MATH_FEEDBACK
    assert set(agent.DEMO_FEEDBACK.split()) <= set(BASE_WORDS)


def test_dapo_gspo_r2_recipe_selects_its_loss_replay_and_dapo_options():
    """The MoE off-policy recipe (docs/rl.md): DAPO with GSPO's sequence-ratio bounds, R2 routing
    replay on a MoE shape, seq-mean-token-mean (the GSPO paper's and verl's GSPO scripts'
    aggregation), no KL reference."""
    argv = ["--config", str(MOE.parent / "qwen3_30b_a3b_dapo_gspo_r2_h100.yaml")]
    cfg, _ = load_config(RLConfig, argv)
    cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
    assert (cfg.algorithm, cfg.policy_loss, cfg.moe.routing_replay) == ("dapo", "gspo", "R2")
    assert (cfg.clip.eps_low, cfg.clip.eps_high) == (0.0003, 0.0004)
    assert cfg.loss.agg_mode == "seq-mean-token-mean" and cfg.kl.beta == 0.0
    assert cfg.dapo.dynamic_sampling and cfg.model.shape == "qwen3-30b-a3b"


def test_dapo_gspo_r2_recipe_passes_validate(capsys):
    from engine.rl.recipe_check import rl_validate_main

    recipe = MOE.parent / "qwen3_30b_a3b_dapo_gspo_r2_h100.yaml"
    assert rl_validate_main(["--config", str(recipe), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "KL reference 0.0" in out and "recipe OK on 4 node(s) x 8 GPUs" in out


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_with_algorithm_defaults(path):
    argv = ["--config", str(path)]
    cfg, _ = load_config(RLConfig, argv)
    cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
    # prompts with images need the hf backend (docs/vlm.md); env.agent is refused with sglang
    # (docs/agents.md)
    assert cfg.rollout.backend == ("vllm" if "vllm" in path.name or "agent" in path.name
                                   else "hf" if "_vl_" in path.name else "sglang")
    assert cfg.model.dtype == "bfloat16"
    assert cfg.train.seq_length >= cfg.rollout.max_new_tokens
    if cfg.algorithm == "dapo":
        # explicit keys win over the preset: the GSPO recipe sets the sequence-ratio bounds
        clip = (0.2, 0.28) if cfg.policy_loss == "ppo_clip" else (0.0003, 0.0004)
        assert (cfg.clip.eps_low, cfg.clip.eps_high, cfg.kl.beta) == (*clip, 0.0)
        assert cfg.dapo.dynamic_sampling and cfg.dapo.overlong_buffer == 4096 // 5
    elif cfg.algorithm == "ppo" or cfg.distill.teacher_path or path.name.startswith("deepseek"):
        assert cfg.kl.beta == 0.0 and cfg.clip.eps_high == 0.2  # no KL reference (headers)
    else:
        assert cfg.kl.beta > 0 and cfg.clip.eps_high == 0.2


@pytest.mark.parametrize("path", DENSE, ids=lambda p: p.name)
@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_validate_prints_placement_and_sync_bytes(path, nodes, capsys):
    from engine.rl.recipe_check import rl_validate_main

    assert rl_validate_main(["--config", str(path), "--validate", "--nodes", str(nodes)]) == 0
    out = capsys.readouterr().out
    owners = [8 * k for k in range(nodes)]  # one engine per node, on its local rank 0
    assert (f"{nodes} rollout engine(s) (1 per node where hosted), 2 GPU(s) per engine, "
            f"owner ranks {owners}") in out
    # Qwen3-8B: 8.19e9 parameters x 2 bytes (bf16) to every engine
    assert f"weight sync per RL step: 16.4 GB to each of {nodes} engine(s)" in out
    assert f"recipe OK on {nodes} node(s) x 8 GPUs" in out


def test_validate_refuses_an_impossible_placement(capsys):
    from engine.rl.recipe_check import rl_validate_main

    argv = ["--config", str(DENSE[0]), "--validate", "rollout.num_engines=3"]
    assert rl_validate_main(argv) == 2
    err = capsys.readouterr().err
    assert "rollout.num_engines=3 must be a multiple of the 2 nodes" in err
    assert rl_validate_main(["--config", str(DENSE[0]), "--validate",
                             "rollout.gpus_per_engine=16"]) == 2
    assert "rollout.gpus_per_engine=16 they need 16 devices but a node runs 8" in \
        capsys.readouterr().err


@pytest.mark.parametrize("nodes,expert_dp,rollout_gib", [(4, 2, 61.8), (8, 4, 56.5)])
def test_moe_recipe_validates_with_memory_of_both_phases(nodes, expert_dp, rollout_gib, capsys):
    """Qwen3-30B-A3B: TP2 x EP8, one 8-GPU SGLang engine per node fed 61.1 GB per step; the
    peak is the rollout phase (resident training state + SGLang's share); more nodes shard
    the expert optimizer state further (optimizer 10.7 GiB at expert-dp 2, half at 4)."""
    from engine.rl.recipe_check import rl_validate_main

    assert rl_validate_main(["--config", str(MOE), "--validate", "--nodes", str(nodes)]) == 0
    out = capsys.readouterr().out
    assert f"tp=2 pp=1 cp=1 ep=8 dp={8 * nodes // 2} on {nodes} node(s)" in out
    assert (f"{nodes} rollout engine(s) (1 per node where hosted), 8 GPU(s) per engine, "
            f"owner ranks {[8 * k for k in range(nodes)]}") in out
    assert f"weight sync per RL step: 61.1 GB to each of {nodes} engine(s)" in out
    assert f"optimizer {10.7 * 2 / expert_dp:.1f}" in out
    assert f"engine 27.9 (SGLang 0.35 x 79.6) = {rollout_gib}" in out
    assert "warning" not in out


@pytest.mark.parametrize("override,needle", [
    ("rollout.sglang.mem_fraction=0.6", "estimated peak memory per GPU 81.7 GiB exceeds "
                                        "recipe.gpu_memory_gib=79.6"),
    ("recipe.expected_memory_gib=50", "recipe.expected_memory_gib=50.0 but the estimated peak "
                                      "is 61.8 GiB"),
])
def test_moe_recipe_memory_problems_name_the_key(override, needle, capsys):
    from engine.rl.recipe_check import rl_validate_main

    assert rl_validate_main(["--config", str(MOE), "--validate", override]) == 2
    assert needle in capsys.readouterr().err


def test_qwen3_5_moe_recipe_validates(capsys):
    """Qwen3.5-35B-A3B GRPO on 4 nodes: TP2 x EP8 with GDN layers and the 248K vocabulary
    through the chunked loss head; its shape counts as transformers' (tests/test_qwen3_5_scale)."""
    from engine.rl.recipe_check import rl_validate_main

    recipe = MOE.parent / "qwen3_5_35b_a3b_grpo_h100.yaml"
    assert rl_validate_main(["--config", str(recipe), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 pp=1 cp=1 ep=8 dp=16 on 4 node(s)" in out
    assert "recipe OK on 4 node(s) x 8 GPUs" in out and "warning" not in out


def test_vllm_recipe_passes_validate_with_the_engine_counted(capsys):
    """The vLLM variant of the Qwen3-8B GRPO recipe: the engine is its
    rollout.vllm.gpu_memory_utilization of the GPU, and its share of the weights fits it."""
    from engine.rl.recipe_check import rl_validate_main

    recipe = RECIPES[0].parent / "qwen3_8b_grpo_vllm_h100.yaml"
    assert rl_validate_main(["--config", str(recipe), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "engine 27.9 (vLLM 0.35 x 79.6) = 68.1" in out
    assert "vLLM engine per GPU (estimate, GiB): weights 7.6" in out and "20.2 left" in out
    assert rl_validate_main(["--config", str(recipe), "--validate",
                             "rollout.vllm.gpu_memory_utilization=0.05"]) == 2
    refused = capsys.readouterr()
    assert "a vLLM engine's share of the weights (bfloat16), 7.6 GiB per GPU" in refused.err
    assert "exceeds rollout.vllm.gpu_memory_utilization=0.05 x 79.6 GiB" in refused.err
