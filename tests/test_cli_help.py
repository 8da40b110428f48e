"""`--help`, `-h` and `--version` of the entry points (engine.config.help): the help is
generated from the config schema, so every key is listed with its type, default and the
schema's own comment, and nothing else needs to be kept in step with it."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.config.help import field_comments, help_text, schema_keys, version
from engine.config.schema import DataConfig, ModelConfig, SFTConfig
from engine.rl.config import RLConfig


@pytest.mark.parametrize("entry, schema, flag", [("engine.sft", SFTConfig, "--help"),
                                                 ("engine.rl", RLConfig, "-h")])
def test_help_lists_every_key_of_the_schema(entry, schema, flag, capsys):
    import importlib

    main = importlib.import_module(f"{entry}.__main__").main
    assert main([flag, "model.hf_path=/nonexistent"]) == 0   # nothing else is read
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {entry}")
    keys = list(schema_keys(schema))
    assert len(keys) > 60
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for key, tp, default, _ in keys:
        assert key in lines, key
        assert f"{tp} = {default}" in lines[key], (key, lines[key])
    assert "Examples:" in out


def test_meanings_are_the_schemas_comments():
    model, data = field_comments(ModelConfig), field_comments(DataConfig)
    assert model["hf_path"] == "HF model directory (weights, config, tokenizer)"   # inline
    assert model["shape"].startswith("A preset of") and "checks that the HF config" in \
        model["shape"]                                                  # the block above
    assert data["truncation"] == "right | error"
    assert "train_files" in data and data["train_files"].startswith("files (.jsonl")
    rows = {k: (t, d) for k, t, d, _ in schema_keys(SFTConfig)}
    assert rows["train.max_steps"] == ("int", "10")
    assert rows["model.hf_path"] == ("str", '""')
    assert rows["model.lora.init_from"] == ("str|null", "null")
    assert rows["optim.betas"][1] == "[0.9,0.95]"


@dataclass
class UndocumentedInner:
    said: int = 1      # a meaning
    bare: int = 2


@dataclass
class Undocumented:
    inner: UndocumentedInner = field(default_factory=UndocumentedInner)
    plain: int = 3


def _entry_schemas() -> dict[str, type]:
    from engine.config.dpo_settings import DPOConfig
    from engine.config.kto_settings import KTOConfig
    from engine.config.rm_settings import RMConfig

    return {"sft": SFTConfig, "rl": RLConfig, "dpo": DPOConfig, "rm": RMConfig, "kto": KTOConfig}


@pytest.mark.parametrize("entry", ["sft", "rl", "dpo", "rm", "kto"])
def test_every_key_of_every_entry_point_has_a_meaning(entry):
    """`--help` gives every key of sft, rl, dpo, rm and kto a meaning (the field's comment, or
    the comment of the base class the field comes from: rl's data.* and logging.* read
    SFT's); a pointer to a docstring names its module. Negative control: a dataclass with
    bare fields is reported (test_preference_keys_have_meanings_and_choices)."""
    rows = list(schema_keys(_entry_schemas()[entry]))
    assert len(rows) > 100
    assert [k for k, _, _, meaning in rows if not meaning] == []
    vague = [k for k, _, _, m in rows if "docstring" in m and not re.search(r"engine\.\w+\.\w+", m)]
    assert vague == []


def test_meanings_name_the_choices_and_what_is_refused():
    """loss.agg_mode names its five modes; optim.qk_clip says its true is refused; rl's
    inherited keys carry SFT's meanings."""
    from engine.training.loss import AGG_MODES

    sft = {k: m for k, _, _, m in schema_keys(SFTConfig)}
    rl = {k: m for k, _, _, m in schema_keys(RLConfig)}
    assert [m for m in AGG_MODES if m not in sft["loss.agg_mode"].replace("|", " ").split()] == []
    assert "refused" in sft["optim.qk_clip"] and "only false" in sft["optim.qk_clip"]
    assert rl["data.train_files"] == sft["data.train_files"] != ""
    assert rl["logging.progress_bar"] == sft["logging.progress_bar"] != ""


def _declared_inline_comments(cls: type) -> dict[str, str]:
    """{field: the comment on the line that declares it}, read line by line from the class's
    own source (independent of engine.config.help's tokenizer walk)."""
    import inspect

    names = {f.name for f in dataclasses.fields(cls)}
    found = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"^    (\w+)\s*:[^#]*#\s*(.+)$", line)
        if m and m.group(1) in names and m.group(1) in cls.__dict__.get("__annotations__", {}):
            found[m.group(1)] = m.group(2).strip()
    return found


def _dataclasses_of(schema: type) -> list[type]:
    seen, todo = [], [schema]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(hints[f.name])]
    return seen


def test_every_help_line_is_the_keys_own():
    """For every dataclass of every entry point's schema, a field declared with an inline
    comment has that comment as its meaning (a comment block above it, such as a section
    heading or the wrapped tail of the previous field's comment, does not replace it); a
    wrapped inline comment keeps its tail; a group's defaults are those its parent builds
    (rl's logging.dir is runs/rl); every choice key lists its choices; every flag of the
    console's usage line is in the flags list. Before the fix moe.aux_loss_type read
    "output_router_logits, else 0", rollout.placement "asynchronous RL (...)", rl's logging.dir
    runs/sft, policy_loss only "...POLICY_LOSSES", and --nproc-per-node was not listed."""
    from engine.config.choices import CHOICES, lists_choices
    from tools.cli import _engine_help

    wrong = []
    for schema in _entry_schemas().values():
        for cls in _dataclasses_of(schema):
            own = field_comments(cls)
            for name, comment in _declared_inline_comments(cls).items():
                if not own.get(name, "").startswith(comment):
                    wrong.append((cls.__name__, name, own.get(name), comment))
    assert wrong == []
    rl = {k: (d, m) for k, _, d, m in schema_keys(RLConfig)}
    assert rl["moe.aux_loss_type"][1] == "aux_loss | seq_aux_loss | global_aux_loss"
    assert rl["moe.aux_loss_coeff"][1] == ("null: HF router_aux_loss_coef if "
                                           "output_router_logits, else 0")
    assert rl["rollout.placement"][1].startswith("colocated | disaggregated")
    assert rl["reward.model.path"][1] == "null: no reward model"
    assert rl["env.agent"][1].startswith("package.module:function(base_url, row)")
    assert rl["logging.dir"][0] == "runs/rl"
    assert rl["policy_loss"][1].endswith("one of ppo_clip | gspo | geo_mean | cispo | sapo")
    for entry, schema in _entry_schemas().items():
        rows = {k: m for k, _, _, m in schema_keys(schema)}
        assert [k for k in CHOICES if k in rows and not lists_choices(k, rows[k])] == [], entry
        assert {k: d for k, _, d, _ in schema_keys(schema)}["logging.dir"] == f"runs/{entry}"
        prog, usage, examples = _engine_help(entry)
        text = help_text(prog, schema, usage, examples)
        flags = text.split("Other flags:")[1].split("Examples:")[0]
        assert [f for f in re.findall(r"--[\w-]+", usage) if f"  {f}" not in flags] == [], entry


def test_help_says_what_a_null_timeout_and_a_micro_batch_are():
    """reward.timeout_s null is no bound (the pool's calls run unbounded, concurrently), not
    "sequential"; train.micro_batch_size counts groups of rows sharing a prefix under
    train.prefix_sharing (sft and rl). Fails on the previous comments."""
    rl = {k: m for k, _, _, m in schema_keys(RLConfig)}
    sft = {k: m for k, _, _, m in schema_keys(SFTConfig)}
    assert "null: unbounded" in rl["reward.timeout_s"]
    assert "sequential" not in rl["reward.timeout_s"]
    for meaning in (rl["train.micro_batch_size"], sft["train.micro_batch_size"]):
        assert "with train.prefix_sharing: groups of rows" in meaning, meaning


def test_rl_docs_name_every_built_in_reward():
    """docs/rl.md's reward.fn row names every built-in reward (it omitted math_verify and
    code), each linked to its section of docs/rewards.md where it has one."""
    from pathlib import Path

    from engine.rl.rewards.registry import BUILTIN_REWARDS

    text = (Path(__file__).parents[1] / "docs" / "rl.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| `reward.fn`")]
    assert [name for name in BUILTIN_REWARDS if f"`{name}`" not in row] == []
    assert "rewards.md#math_verify" in row and "rewards.md#code" in row


def test_version(capsys):
    from engine.sft.__main__ import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"engine.sft {version()}"
    assert version() != "unknown"   # the package is installed (pip install -e .)


def _undocumented(keys: list[str], text: str) -> list[str]:
    return [k for k in keys if f"`{k}`" not in text and f"`{k}=" not in text
            and f"`{k} " not in text]


@pytest.mark.parametrize("schema", [SFTConfig, RLConfig])
def test_every_key_is_documented(schema):
    """Every key of the schema is named, whole and in backticks, somewhere under docs/ (the
    configuration tables of sft.md, rl.md, rollout-backends.md, ...). Negative control: a key
    the docs do not name is reported."""
    from pathlib import Path

    text = "\n".join(p.read_text() for p in (Path(__file__).parents[1] / "docs").glob("*.md"))
    assert _undocumented([k for k, *_ in schema_keys(schema)], text) == []
    assert _undocumented(["train.max_steps", "train.no_such_key"], text) == ["train.no_such_key"]


def test_library_warnings_are_filtered_and_megatrons_fallback_said_once():
    """The warnings megatron-core and torch raise that a user cannot act on
    (parallel.LIBRARY_WARNINGS: the six "Transformer Engine and Apex are not installed" of
    megatron's import, its optimizer's non-leaf .grad read, torch's collective and checkpoint
    deprecations) are filtered in every process that imports `parallel`; the launch says the
    fallback once (engine.run.launch.kernel_notice, checked in tests/test_rl_loop.py). Negative
    controls: another UserWarning still reaches the user, and ENGINE_LIBRARY_WARNINGS=1 shows
    them all."""
    import os
    import warnings

    from engine.run.launch import kernel_notice
    from parallel import CPU_ONLY_WARNINGS, LIBRARY_WARNINGS, SHOW_ENV, quiet_library_warnings

    examples = [
        (UserWarning, "Transformer Engine and Apex are not installed. Falling back"),
        (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
        (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being "
                      "accessed. Its .grad attribute won't be populated"),
        (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use"),
        (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use"),
        (FutureWarning, "`load_state_dict` is deprecated and will be removed"),
        (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
        (UserWarning, "When using sequence parallelism it is recommended to set the environment "
                      "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"),
    ]
    assert len(LIBRARY_WARNINGS) + len(CPU_ONLY_WARNINGS) == 6  # each has an example above

    def shown(show_env: str | None) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            # without pytest.ini's blanket ignores; anything not filtered is shown
            warnings.filters[:] = [f for f in warnings.filters if not (
                f[0] == "ignore" and f[1] is None and f[2] in (UserWarning, FutureWarning))]
            warnings.filterwarnings("always", append=True)
            old = os.environ.pop(SHOW_ENV, None)
            if show_env is not None:
                os.environ[SHOW_ENV] = show_env
            try:
                # installed again here: pytest restores the filters its collection phase
                # changed, where `parallel` was first imported; a run keeps them from then on
                quiet_library_warnings()
            finally:
                os.environ.pop(SHOW_ENV, None)
                if old is not None:
                    os.environ[SHOW_ENV] = old
            for category, message in examples:
                warnings.warn(message, category)
            warnings.warn("something actionable", UserWarning)
        return [str(w.message) for w in seen]

    assert shown(None) == ["something actionable"]
    assert len(shown("1")) == len(examples) + 1
    assert kernel_notice().startswith("Transformer Engine not installed: torch layers")


def test_preference_keys_have_meanings_and_choices():
    """`dpo --help`, `kto --help` and `rm --help` give each objective's own keys a meaning;
    dpo.loss_type's names every loss type (ORPO included). Negative control: a key without a
    comment is reported."""
    from engine.config.dpo_settings import LOSS_TYPES, DPOConfig
    from engine.config.kto_settings import KTOConfig
    from engine.config.rm_settings import RMConfig

    def bare(schema, prefix):
        return [k for k, _, _, meaning in schema_keys(schema)
                if k.startswith(prefix) and not meaning]

    assert bare(DPOConfig, "dpo.") == [] and bare(KTOConfig, "kto.") == []
    assert bare(RMConfig, "rm.") == []
    assert bare(Undocumented, "") == ["inner.bare", "plain"]   # a key without a comment is found
    meaning = {k: m for k, _, _, m in schema_keys(DPOConfig)}["dpo.loss_type"]
    assert [t for t in LOSS_TYPES if t not in meaning.replace("|", " ").split()] == []


def test_top_level_help_names_every_preference_objective():
    """The console's overview names each dpo.loss_type under the name papers and TRL use, and
    `rm score`."""
    from engine.config.dpo_settings import LOSS_TYPES
    from tools.cli import usage

    names = {"sigmoid": "DPO", "ipo": "IPO", "hinge": "hinge", "robust": "robust",
             "simpo": "SimPO", "orpo": "ORPO"}
    lines = {line.split()[0]: line for line in usage().splitlines() if line.startswith("  ")}
    assert [t for t in LOSS_TYPES if names[t] not in lines["dpo"]] == []
    assert "`rm score`" in lines["rm"] and "KTO" in lines["kto"]


def test_commands_say_what_they_wrote_in_the_right_number(tmp_path, capsys):
    """`demo model` and `demo addition-data` print what they wrote (they printed nothing);
    `rm score`'s summary counts in the singular for one row and one pair ("scored 1 rows")."""
    from engine.rm.score import summary
    from tools.demo import main as demo_main

    demo_main(["addition-data", str(tmp_path)])
    said = capsys.readouterr().out
    assert said.strip() == (f"wrote {tmp_path / 'sft.jsonl'} (100 rows), "
                            f"{tmp_path / 'rl.jsonl'} (100 rows)")
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 100
    demo_main(["model", str(tmp_path / "m"), "--hidden", "32", "--layers", "1",
               "--intermediate", "32"])
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {tmp_path / 'm'}: a tiny random Qwen3 (hidden 32, layers 1) "
                           "with 1 head of 32 dims")
    assert (tmp_path / "m" / "config.json").exists()
    assert summary([{"score": 1.0}]) == "scored 1 row"
    assert summary([{"score": 1.0}, {"chosen": 2.0, "rejected": 1.0, "margin": 1.0}]) \
        .startswith("scored 2 rows; 1 pair: accuracy 1.0000")


SCHEMA_REFS = {"sft": "engine.config.schema:SFTConfig", "rl": "engine.rl.config:RLConfig",
               "dpo": "engine.config.dpo_settings:DPOConfig",
               "rm": "engine.config.rm_settings:RMConfig",
               "kto": "engine.config.kto_settings:KTOConfig"}


@pytest.mark.parametrize("entry", SCHEMA_REFS)
def test_the_schema_read_from_source_is_the_schema(entry):
    """What `--help` and the first parse use (engine.config.schema_source, no heavy import) is
    the imported schema: the same help text, and hydra composes or refuses each command line
    alike."""
    from engine.config.loading import load_config
    from engine.config.schema_source import real_schema, source_schema
    from engine.errors import ConfigError

    light, real = source_schema(SCHEMA_REFS[entry]), real_schema(SCHEMA_REFS[entry])
    assert light is not real
    assert help_text("p", light, "u", ["e"]) == help_text("p", real, "u", ["e"])

    def outcome(schema, argv):
        try:
            return repr(load_config(schema, argv)[0])
        except ConfigError as e:
            return str(e)

    for argv in (["train.max_stepz=3"], ["train.max_steps=abc"], ["model.lora.rank=4",
                 "data.train_files=[a.jsonl]"], ["data.train_files=a.jsonl"], ["+seed2=1"],
                 ["optim.muon.ns_steps=x", "optim.name=muon"], ["logging.dir=null"]):
        assert outcome(light, argv) == outcome(real, argv), argv


GUARD = """
import runpy, sys
class Forbidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron", "transformers"):
            raise ImportError(f"{name} imported before the command line was parsed")
sys.meta_path.insert(0, Forbidden())
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _guarded(module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", GUARD, module, *argv], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[1])


def test_help_and_refusals_import_no_torch_megatron_or_transformers():
    """--help of every entry point (module and console command), `rm score --help` and the
    refusal of a bad key or a bad type answer before torch, megatron-core or transformers is
    imported (an import of any of them fails the subprocess): the 5-14 s these imports cost
    are not paid to print help or to name a typo. Negative control: --validate, which needs
    them, fails under the same guard."""
    for entry in SCHEMA_REFS:
        proc = _guarded(f"engine.{entry}", "--help")
        usage = f"usage: python -m engine.{entry}"
        assert proc.returncode == 0 and proc.stdout.startswith(usage), proc.stderr[-2000:]
        assert len(proc.stdout.splitlines()) > 100
    proc = _guarded("tools.cli", "rl", "-h")
    assert proc.returncode == 0 and "rollout.vllm.speculative.patience_steps" in proc.stdout
    proc = _guarded("engine.rm", "score", "--help")
    assert proc.returncode == 0 and "--trust-remote-code" in proc.stdout, proc.stderr[-2000:]
    proc = _guarded("engine.sft", "optim.lrr=1e-5")
    assert proc.returncode == 2 and proc.stderr.startswith(
        "error: unknown key optim.lrr on the command line; valid keys of optim: lr,")
    proc = _guarded("tools.cli", "rl", "rollout.n=eight")
    assert proc.returncode == 2 and "rollout.n (on the command line): Value 'eight'" in \
        proc.stderr, proc.stderr[-2000:]
    proc = _guarded("engine.sft", "--config", "recipes/sft/qwen3_8b_h100.yaml", "--validate")
    assert proc.returncode != 0 and "imported before the command line was parsed" in proc.stderr


def test_invalid_choices_are_refused_before_the_heavy_imports():
    """A value that is none of its key's choices (engine.config.choices) is refused like an
    unknown key: exit 2 naming the key, the value and every choice, with torch, megatron-core
    and transformers never imported (the guard fails the subprocess on their import; before
    the fix the refusal came from the full validation, after ~20 s of those imports, and the
    guard failed it). Every problem is named at once; a valid choice passes the early check."""
    proc = _guarded("engine.rl", "rollout.placement=foo")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == ("error: rollout.placement='foo' is not valid; choose one of "
                           "colocated, disaggregated\n")
    proc = _guarded("tools.cli", "dpo", "dpo.loss_type=nope", "checkpoint.schedule=keep")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "error: invalid configuration:",
        "  - checkpoint.schedule='keep' is not valid; choose one of same, checkpoint, config",
        "  - dpo.loss_type='nope' is not valid; choose one of sigmoid, ipo, hinge, robust, "
        "simpo, orpo"]
    proc = _guarded("engine.rl", "rollout_correction.rollout_rs='token_k1,seq_k9'")
    assert proc.returncode == 2 and "rollout_correction.rollout_rs='token_k1,seq_k9' is not " \
        "valid; choose one of null, token_k1," in proc.stderr, proc.stderr[-2000:]
    # control: valid choices pass the early check and reach the heavy imports (the guard)
    proc = _guarded("engine.rl", "rollout.placement=disaggregated", "policy_loss=gspo")
    assert proc.returncode != 0 and "imported before the command line was parsed" in proc.stderr


def test_the_choice_table_is_the_codes():
    """engine.config.choices.CHOICES (read without heavy imports) holds, for every key with a
    table in the code, exactly that table's values (SOURCES); the keys are real keys of an
    entry point's schema, and the defaults are valid choices."""
    import importlib

    from engine.config.choices import CHOICES, NULL_OK, SOURCES, choice_problems

    for key, ref in SOURCES.items():
        module, name = ref.split(":")
        assert tuple(getattr(importlib.import_module(module), name)) == CHOICES[key], key
    keys = {k for schema in _entry_schemas().values() for k, _, _, _ in schema_keys(schema)}
    assert sorted(set(CHOICES) - keys) == []
    for schema in _entry_schemas().values():
        assert choice_problems(schema()) == [], schema
    assert NULL_OK <= set(CHOICES)


def test_the_run_header_says_what_runs():
    """The `[sft] runs:` / `[rl] runs:` line (engine.run.header) changes with optim.name=muon,
    optim.fused=true, train.compile=true, packing, train.skip_unread_positions and the rollout
    settings, each resolved for the host (the kernels line read the same for all of them). Each change is compared with
    every line seen before: a header that ignored a key would repeat one."""
    from engine.run.header import Host, run_header

    cpu, gpu = Host(cuda=False, flash=False, te=False), Host(cuda=True, flash=True, te=False)
    base = SFTConfig()
    line = run_header(base, cpu)
    assert line == ("optimizer adamw, unfused (optim.fused=null), distributed optimizer; "
                    "layers eager (train.compile=null), the last layer's MLP only where a loss "
                    "reads (train.skip_unread_positions=true); attention torch SDPA over padded "
                    "rows (train.packing=false)")
    seen = {line}
    for key, value in (("optim.name", "muon"), ("optim.fused", True), ("train.compile", "true"),
                       ("train.packing", True), ("train.skip_unread_positions", False)):
        cfg = SFTConfig()
        group, name = key.split(".")
        setattr(getattr(cfg, group), name, value)
        changed = run_header(cfg, cpu)
        assert changed not in seen, key
        seen.add(changed)
    assert "optimizer muon (Muon on the 2-D hidden weights), its AdamW unfused" in \
        run_header(_with(SFTConfig(), optim__name="muon"), cpu)
    assert "adamw, fused (optim.fused=true)" in run_header(_with(SFTConfig(), optim__fused=True),
                                                           cpu)
    assert "the last layer's MLP at every position (train.skip_unread_positions=false)" in \
        run_header(_with(SFTConfig(), train__skip_unread_positions=False), cpu)
    assert "layers compiled (train.compile=true)" in run_header(
        _with(SFTConfig(), train__compile="true"), cpu)
    on_gpu = run_header(_with(SFTConfig(), train__packing=True, model__dtype="bfloat16"), gpu)
    assert "adamw, fused (optim.fused=null)" in on_gpu and "layers compiled" in on_gpu
    assert "attention flash varlen, one call per packed row" in on_gpu
    assert "SDPA per packed segment (train.packing=true; no CUDA)" in run_header(
        _with(SFTConfig(), train__packing=True), cpu)
    rl = RLConfig()
    assert run_header(rl, cpu).endswith("; rollout hf (dynamic KV cache, eager decode)")
    assert run_header(rl, gpu).endswith("; rollout hf (static KV cache, compiled decode)")
    assert run_header(_with(rl, rollout__backend="vllm"), cpu).endswith("rollout vllm (eager)")
    assert "rollout hf (static KV cache, eager decode)" in run_header(
        _with(RLConfig(), rollout__hf__static_cache=True), cpu)
    docs = (Path(__file__).parents[1] / "docs" / "sft.md").read_text()   # its two examples
    assert f"\n[sft] runs: {line}\n" in docs
    h100 = _with(RLConfig(), optim__name="muon", train__packing=True, model__dtype="bfloat16")
    assert f"\n[rl] runs: {run_header(h100, gpu)}\n" in docs


def _with(cfg, **keys):
    """`cfg` with `group__name=value` keys set (a nested key per `__`)."""
    for key, value in keys.items():
        *groups, name = key.split("__")
        node = cfg
        for group in groups:
            node = getattr(node, group)
        setattr(node, name, value)
    return cfg
