"""Every configuration and data error a user can meet, met the way a user meets it: through
`python -m engine.sft` / `engine.rl` (or torchrun). Each case checks the contract of
engine.run.launch.run_entry: the worker exits with code 2, one `error: ...` report on stderr (rank 0
only) names the key, the constraint and the valid values (file:line for a row of data), and no
traceback runs through our code (engine/, models/, parallel/).

Configuration errors are found before any process group exists, so most cases call the
module's `main(argv)` in this process with the environment of rank 0 of an N-rank job (RANK=0,
WORLD_SIZE=N, LOCAL_RANK=0: run_entry reads the world size from WORLD_SIZE; tests.launch.run_main
fails the case if the run gets as far as starting torch.distributed); one case runs on 4 ranks
to show the report is printed once. Data errors come after the process groups, so they run as
real (1 or 2 rank) jobs: `python -m MODULE` on the ranks of the session's rank pool
(tests/pool.py), every rank's output in one stream as torchrun merges them.
"""
from __future__ import annotations

import json
import importlib
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from engine.training.loss import AGG_MODES
from tests.launch import run_main
from tools.tiny_models import build_tiny_model

OUR_TRACEBACK = re.compile(r'File ".*/(engine|models|parallel)/')


def chat_row(a: int, b: int) -> dict:
    """A chat row; with single digits a, b and a + b >= 10 it renders to 21 ids with the tiny
    tokenizer (14 of them the prompt, not trained)."""
    return {"messages": [{"role": "user", "content": f"what is {a} + {b} ?"},
                         {"role": "assistant", "content": f"the answer is {a + b}"}]}


def write_lines(path: Path, lines: list) -> str:
    """Write `lines` (dicts as JSON, strings verbatim) one per line; return the path."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n"
                            for x in lines))
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Placeholders of the case arguments: a tiny Qwen3 (8 heads, 2 KV heads, 4 layers), broken
    copies of it, and data files with one defect each (at a known line)."""
    root = tmp_path_factory.mktemp("cli_errors")
    model = build_tiny_model(str(root / "model"), "qwen3", hidden=64, layers=4, heads=8,
                             kv_heads=2, intermediate=64)
    config = json.loads((root / "model" / "config.json").read_text())
    (root / "mistral").mkdir()
    (root / "mistral" / "config.json").write_text(json.dumps({**config,
                                                               "model_type": "mistral"}))
    shutil.copytree(model, root / "no_template")
    (root / "no_template" / "chat_template.jinja").unlink()
    rows = [chat_row(a, 5) for a in range(5, 9)]
    good = chat_row(5, 5)
    return {
        "model": model, "mistral": str(root / "mistral"),
        "no_template": str(root / "no_template"), "tmp": str(root),
        "train": write_lines(root / "train.jsonl", rows),
        "bad_json": write_lines(root / "bad_json.jsonl", [good, good, good, '{"messages": [']),
        "no_response": write_lines(root / "no_response.jsonl",
                                   [good, {"prompt": "what is 1 + 2 ?"}]),
        "empty": write_lines(root / "empty.jsonl", []),
        "prompts": write_lines(root / "prompts.jsonl",
                               [{"prompt": f"what is {a} + 1 ?", "answer": str(a + 1)}
                                for a in range(4)]),
        "prompts_no_answer": write_lines(root / "prompts_no_answer.jsonl",
                                         [{"prompt": "what is 1 + 2 ?", "answer": "3"},
                                          {"prompt": "what is 2 + 2 ?"}]),
    }


@dataclass(frozen=True)
class Case:
    """One user error: the base arguments of `module` plus `args` ({placeholders}: the `paths`
    fixture, {data}: its entry `data`, the training file), launched as rank 0 of a `world`-rank
    job (None: a real job of `nproc` ranks, under torchrun when > 1); `needles`: the texts the
    report must contain."""

    name: str
    args: tuple[str, ...]
    needles: tuple[str, ...]
    world: int | None = 1
    module: str = "engine.sft"
    nproc: int = 1
    data: str = "train"

    def argv(self, paths: dict[str, str]) -> list[str]:
        base = SFT_BASE if self.module == "engine.sft" else RL_BASE
        values = {**paths, "data": paths[self.data]}
        return ["-m", self.module, *(a.format(**values) for a in (*base, *self.args))]

    def expected(self, paths: dict[str, str]) -> list[str]:
        return [n.format(**paths) for n in self.needles]


SFT_BASE = ("model.hf_path={model}", "data.train_files=[{data}]", "train.seq_length=32",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=1",
            "optim.schedule=constant", "logging.progress_bar=false", "logging.dir={tmp}/log")
RL_BASE = ("model.hf_path={model}", "data.train_files=[{data}]", "kl.beta=0",
           "rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=4",
           "train.seq_length=32", "train.max_steps=1", "logging.progress_bar=false",
           "logging.dir={tmp}/rl_log")

CONFIG_CASES = [
    Case("world_size_vs_tp_pp_cp", ("parallel.tp=2",), world=3, needles=(
        "world size 3", "parallel.tp x parallel.pp x parallel.cp = 2 x 1 x 1 = 2",
        "valid (tp, pp, cp) products divide 3: [1, 3]")),
    Case("heads_vs_tp_cp", ("parallel.tp=4", "parallel.cp=4"), world=16, needles=(
        "num_attention_heads=8 is not divisible by parallel.tp x parallel.cp = 4 x 4 = 16",
        "valid tp x cp products: [1, 2, 4, 8]",
        "num_key_value_heads=2 is not divisible by parallel.tp=4", "valid tp: [1, 2]")),
    Case("layers_vs_pp_vpp", ("parallel.pp=2", "parallel.vpp=4"), world=2, needles=(
        "num_hidden_layers=4 is not divisible by parallel.pp x parallel.vpp = 2 x 4 = 8",
        "valid pp x vpp products: [1, 2, 4]")),
    Case("seq_length_vs_cp", ("parallel.cp=2", "train.seq_length=30"), world=2, needles=(
        "train.seq_length=30 must be divisible by 2 x parallel.cp = 4",
        "nearest valid: 28 or 32")),
    Case("unknown_agg_mode_and_truncation", ("loss.agg_mode=mean", "data.truncation=left"),
         needles=("loss.agg_mode='mean' is not valid; choose one of " + ", ".join(AGG_MODES),
                  "data.truncation='left' is not valid; choose one of right, error")),
    Case("unknown_algorithm", ("algorithm=trpo",), module="engine.rl", data="prompts",
         needles=("algorithm='trpo' is not valid; choose one of grpo, ppo, dapo",)),
    Case("missing_model_path", ("model.hf_path={tmp}/nowhere",), needles=(
        "model.hf_path={tmp}/nowhere: HF model directory not found",)),
    Case("missing_or_unsupported_data_files",
         ("data.train_files=[{tmp}/missing.jsonl,{tmp}/rows.json]",), needles=(
             "data.train_files: file not found: {tmp}/missing.jsonl",
             "data.train_files: {tmp}/rows.json has extension '.json'; supported: .jsonl, "
             ".parquet")),
    Case("unsupported_architecture", ("model.hf_path={mistral}",), needles=(
        "model.hf_path={mistral}: unsupported architecture model_type='mistral'",
        "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM)")),
    Case("tokenizer_without_chat_template", ("model.hf_path={no_template}",), needles=(
        "model.hf_path={no_template}: the tokenizer has no chat template",)),
    Case("unknown_key", ("train.nonexistent=1",), needles=(
        "unknown key train.nonexistent on the command line; valid keys of train:",
        "seq_length")),
    # optim.name=muon (docs/optimizers.md): refused by name before any process group, for SFT
    # and for RL (the same optim keys)
    Case("muon_with_param_gather_overlap", ("optim.name=muon",
                                            "parallel.overlap_param_gather=true"), needles=(
        "parallel.overlap_param_gather=true needs optim.distributed_optimizer=true with "
        "optim.name=adamw",)),
    # an invalid choice is refused first, alone, before the heavy imports (engine.config.choices)
    Case("muon_tp_mode", ("optim.name=muon", "optim.distributed_optimizer=false",
                          "optim.muon.tp_mode=rows", "optim.qk_clip=true"),
         module="engine.rl", data="prompts", needles=(
             "optim.muon.tp_mode='rows' is not valid; choose one of duplicated, distributed, "
             "blockwise",)),
    Case("muon_qk_clip", ("optim.name=muon", "optim.distributed_optimizer=false",
                          "optim.qk_clip=true"),
         module="engine.rl", data="prompts", needles=("optim.qk_clip=true is not supported",)),
]

DATA_CASES = [
    Case("malformed_json", (), world=None, nproc=2, data="bad_json", needles=(
        "{bad_json}:4: invalid JSON (Expecting value at column 15)",)),
    Case("missing_field", (), world=None, data="no_response", needles=(
        "{no_response}:2: missing field 'response'",)),
    Case("empty_file", (), world=None, data="empty", needles=(
        "no training samples in {empty}: the files hold no rows",)),
    Case("no_trained_token_left", ("train.seq_length=8",), world=None, needles=(
        "none of the 4 samples has an assistant/response token left",
        "4 rows were cut to train.seq_length=8 tokens (the longest needs 20)")),
    Case("too_long_with_truncation_error", ("train.seq_length=16", "data.truncation=error"),
         world=None, needles=(
             "{train}:1: rendered row has 21 tokens, more than train.seq_length + 1 = 17 "
             "(data.truncation=error)",)),
    Case("rl_prompt_missing_answer", (), world=None, module="engine.rl",
         data="prompts_no_answer", needles=("{prompts_no_answer}:2: missing field 'answer'",)),
]


FOUR_RANKS = Case("world_size_with_4_ranks", ("parallel.tp=3",), world=None, nproc=4, needles=(
    "world size 4 is not divisible by parallel.tp x parallel.pp x parallel.cp = 3 x 1 x 1 = 3",
    "valid (tp, pp, cp) products divide 4: [1, 2, 4]",
    "num_attention_heads=8 is not divisible by parallel.tp x parallel.cp = 3 x 1 = 3",
    "num_key_value_heads=2 is not divisible by parallel.tp=3"))
TRUNCATE_RIGHT = Case("too_long_with_truncation_right", ("train.seq_length=16",), world=None,
                      needles=())


def launch(case: Case, paths: dict[str, str], pools=None) -> subprocess.CompletedProcess:
    """Run `case` as its user would (see Case); returns the CompletedProcess. A configuration
    error (`case.world` set): `main(argv)` of the module in this process as rank 0 of that
    world; otherwise `python -m MODULE` on `case.nproc` ranks of the rank pool `pools`, the
    ranks' stdout and stderr each joined in rank order (as torchrun prints them)."""
    argv = case.argv(paths)
    if case.world is not None:
        main = importlib.import_module(f"{case.module}.__main__").main
        rank0 = {"RANK": "0", "WORLD_SIZE": str(case.world), "LOCAL_RANK": "0"}
        return run_main(main, argv[2:], env=rank0, label=f"python -m {case.module}")
    return pools.script(case.nproc, *argv, check=False, timeout=240).merged()


@pytest.fixture(scope="module")
def outcomes(paths, pools) -> Callable[[Case], subprocess.CompletedProcess]:
    """`outcome(case)`: the finished run of `case` (run once, when a test first asks)."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def outcome(case: Case) -> subprocess.CompletedProcess:
        if case.name not in done:
            done[case.name] = launch(case, paths, pools)
        return done[case.name]

    return outcome


def worker_exit_code(proc) -> int:
    """The exit code of the worker: the process (or pool case) itself, or under torchrun the
    exitcode of the root cause in torchrun's failure summary (torchrun itself exits 1)."""
    if "torch.distributed.run" not in proc.args:
        return proc.returncode
    found = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", proc.stderr, re.S)
    assert found, "no failure summary from torchrun"
    return int(found.group(1))


def assert_reported_once(proc, needles: list[str]) -> None:
    """Exit code 2, one `error:` report holding every needle, no traceback through our code."""
    assert worker_exit_code(proc) == 2, proc.stderr[-3000:]
    reports = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(reports) == 1, reports
    for needle in needles:
        assert needle in proc.stderr, needle
    assert not OUR_TRACEBACK.search(proc.stderr + proc.stdout)
    if proc.returncode == 2:  # a plain process: no traceback at all
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.name)
def test_config_error(case, paths, outcomes):
    assert_reported_once(outcomes(case), case.expected(paths))


@pytest.mark.parametrize("case", [FOUR_RANKS], ids=lambda c: c.name)
def test_config_error_with_4_ranks_is_reported_once(case, paths, outcomes):
    proc = outcomes(case)
    assert proc.returncode != 0
    assert_reported_once(proc, case.expected(paths))


@pytest.mark.parametrize("case", DATA_CASES, ids=lambda c: c.name)
def test_data_error(case, paths, outcomes):
    assert_reported_once(outcomes(case), case.expected(paths))


@pytest.mark.parametrize("case", [TRUNCATE_RIGHT], ids=lambda c: c.name)
def test_truncated_rows_are_counted_in_the_log(case, outcomes):
    """data.truncation=right (the default) cuts the 4 rows of 21 ids to 17, trains, and says
    how many rows it cut and dropped on stdout (rank 0)."""
    proc = outcomes(case)
    assert proc.returncode == 0
    # the run header (engine.run.header) resolved for this CPU host, once (rank 0)
    assert proc.stdout.count("[sft] runs: ") == 1
    assert "[sft] runs: optimizer adamw, unfused (optim.fused=null), distributed optimizer; " \
        "layers eager (train.compile=null), the last layer's MLP only where a loss reads " \
        "(train.skip_unread_positions=true); attention torch SDPA over padded rows " \
        "(train.packing=false)\n" in proc.stdout
    assert [int(n) for n in re.findall(r"truncated\W+(\d+)", proc.stdout)] == [4]
    assert [int(n) for n in re.findall(r"dropped\w*\W+(\d+)", proc.stdout)] == [0]


# ----------------------------------------------------------------------------- in-process
# The same checks without a launch, for the variants the cases above do not run.

def test_model_dir_problems_name_what_is_missing(paths, tmp_path):
    from models.hf.io import training_dir_problems

    assert training_dir_problems(paths["model"]) == []
    assert training_dir_problems(paths["mistral"]) == [
        "no weights: model.safetensors or model.safetensors.index.json is missing",
        "no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt is "
        "present"]
    shutil.copytree(paths["no_template"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "{{ messages }}"}))
    assert training_dir_problems(tmp_path / "m") == []


@pytest.mark.parametrize("yaml_text,message", [
    ("train:\n  seqlen: 4\n", "unknown key train.seqlen in --config {file}; valid keys of "
                              "train: global_batch_size, micro_batch_size,"),
    ("train:\n  seq_length: abc\n", "train.seq_length (in --config {file}): Value 'abc' of type "
                                    "'str' could not be converted to Integer"),
    ("train: [\n", "invalid configuration in --config {file}: while parsing"),
])
def test_config_file_errors_name_the_key_and_the_file(tmp_path, yaml_text, message):
    from engine.config.schema import ConfigError, SFTConfig, load_config

    file = tmp_path / "run.yaml"
    file.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, ["--config", str(file)])
    assert message.format(file=file) in str(info.value)
    with pytest.raises(ConfigError, match="--config .*missing.yaml: file not found"):
        load_config(SFTConfig, ["--config", str(tmp_path / "missing.yaml")])


@dataclass
class _LimitsGroup:
    size: int = 1
    limits: dict[str, int] = field(default_factory=dict)  # a typed free-form dict


@dataclass
class _DictSchema:
    group: _LimitsGroup = field(default_factory=_LimitsGroup)
    extra: dict = field(default_factory=lambda: {"x": 1})  # untyped, with a default entry


@pytest.mark.parametrize("argv,expected", [
    (["env.kwargs={fail_step:2}"], {"fail_step": 2}),           # hydra's dict value
    (["env.kwargs={fail_step:2,name:x}"], {"fail_step": 2, "name": "x"}),
    (["+env.kwargs.fail_step=2"], {"fail_step": 2}),            # append
    (["env.kwargs.fail_step=2"], {"fail_step": 2}),             # plain dotted key
    (["env.kwargs={a:1}", "env.kwargs.b=2", "+env.kwargs.c={d:3}"],
     {"a": 1, "b": 2, "c": {"d": 3}}),
])
def test_free_form_dict_keys_take_every_hydra_form(argv, expected):
    """env.kwargs (Dict[str, Any]) takes new keys as key={a:1}, key.a=1 and +key.a=1, in
    process (engine.config.loading.load_config); so does a YAML file."""
    from engine.config.schema import load_config
    from engine.rl.config import RLConfig

    cfg, _ = load_config(RLConfig, argv)
    assert cfg.env.kwargs == expected


def test_free_form_dict_in_a_group_and_in_a_config_file(tmp_path):
    """The same for another dict field: a typed Dict[str, int] inside a group (values still
    checked, the key named) and an untyped top-level dict with a default entry (merged, as
    hydra merges a dict value); a --config file's dict keys combine with the overrides."""
    from engine.config.schema import ConfigError, load_config

    for argv in (["group.limits={a:1,b:2}"], ["group.limits.a=1", "+group.limits.b=2"]):
        cfg, _ = load_config(_DictSchema, argv)
        assert cfg.group.limits == {"a": 1, "b": 2} and cfg.group.size == 1
    cfg, _ = load_config(_DictSchema, ["extra={y:2}", "extra.z.w=3"])
    assert cfg.extra == {"x": 1, "y": 2, "z": {"w": 3}}
    for argv in (["group.limits={a:many}"], ["group.limits.a=many"]):
        with pytest.raises(ConfigError, match=r"group.limits.a \(on the command line\): Value "
                                              "'many' of type 'str' could not be converted"):
            load_config(_DictSchema, argv)
    file = tmp_path / "run.yaml"
    file.write_text("env:\n  kwargs:\n    fail_step: 2\n")
    from engine.rl.config import RLConfig

    cfg, _ = load_config(RLConfig, ["--config", str(file), "env.kwargs.name=x"])
    assert cfg.env.kwargs == {"fail_step": 2, "name": "x"}


@pytest.mark.parametrize("argv,message", [
    (["env.kwarg={a:1}"], "unknown key env.kwarg on the command line; valid keys of env: fn, "
                          "kwargs, tools, max_turns, num_workers, step_timeout_s"),
    (["rollout.temprature=1"], "unknown key rollout.temprature on the command line; valid "
                               "keys of rollout: backend, num_engines,"),
    (["env={max_turn:3}"], "unknown key env.max_turn on the command line; valid keys of env:"),
    (["+rollout.temprature=1"], "unknown key rollout.temprature on the command line; valid "
                                "keys of rollout: backend, num_engines,"),
    (["++env.max_turn=3"], "unknown key env.max_turn on the command line; valid keys of env: "
                           "fn, kwargs, tools, max_turns,"),
    (["+group.sizes=2"], "unknown key group.sizes on the command line; valid keys of group: "
                         "size, limits"),
])
def test_typo_in_a_fixed_key_is_refused_with_the_valid_keys(argv, message):
    """Negative control: opening the free-form dicts leaves every fixed group closed; with
    hydra's + / ++ too (before, those set an attribute of the dataclass nobody reads)."""
    from engine.config.schema import ConfigError, load_config
    from engine.rl.config import RLConfig

    with pytest.raises(ConfigError) as info:
        load_config(_DictSchema if argv[0].startswith("+group") else RLConfig, argv)
    assert message in str(info.value)
