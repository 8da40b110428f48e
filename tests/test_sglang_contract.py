"""Contract test of the SGLang backend against the real sglang package of the tested release.

SGLang cannot run on these hosts (its CPU kernel is GitHub source only), but its Python package
is on the registry. It is installed without its dependencies into a folder of its own, outside
the environment (its dependencies pin a CUDA torch):

    python -m pip install --no-deps --target ~/.cache/megatron-sft-engine/sglang-0.5.23 sglang==0.5.23

(.ci/run installs it elsewhere and names the folder in CONTRACT_SGLANG_DIR, which overrides
that default). Nothing is imported from it: the modules' source is parsed (`ast`) and every
SGLang name the backend uses (engine.generation.sglang.settings: Engine methods and the keyword
arguments passed to them, ServerArgs fields, sampling_params keys) is looked up as used, as are
the behaviours the backend relies on. tests/test_sglang_backend.py checks that the backend uses
nothing outside those tables. Without the folder the test fails, saying how to install it.
"""
from __future__ import annotations

import ast
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest

from engine.generation.sglang import settings as sglang_settings
from engine.generation.sglang.settings import (DETERMINISTIC_ATTENTION_BACKENDS, ENGINE_CALLS,
                                               MEMORY_SAVER_PACKAGE, SAMPLING_KEYS, SERVER_ARGS,
                                               TESTED_VERSION)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path.home() / ".cache" / "megatron-sft-engine" / f"sglang-{TESTED_VERSION}"
INSTALL = (f"python -m pip install --no-deps --target {DEFAULT_DIR} sglang=={TESTED_VERSION} "
           "(or set CONTRACT_SGLANG_DIR to a folder holding it; README's set-up installs it)")


@pytest.fixture(scope="module")
def sgl() -> Path:
    """The installed package's `sglang` folder (fails, saying how to install it, without)."""
    folder = Path(os.environ.get("CONTRACT_SGLANG_DIR") or DEFAULT_DIR)
    if not (folder / "sglang" / "srt" / "entrypoints" / "engine.py").is_file():
        pytest.fail(f"sglang {TESTED_VERSION}'s package is not in {folder}: {INSTALL}")
    [meta] = folder.glob("sglang-*.dist-info/METADATA")
    version = re.search(r"^Version: (\S+)$", meta.read_text(), re.M).group(1)
    assert version == TESTED_VERSION, f"{folder} holds sglang {version}: {INSTALL}"
    return folder / "sglang"


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _class(path: Path, name: str) -> ast.ClassDef:
    found = [n for n in _tree(path).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name} in {path}"
    return found[0]


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _source(sgl: Path, module: str) -> Path:
    return sgl.parent / (module.replace(".", "/") + ".py")


def test_the_engine_and_its_version_are_where_the_backend_imports_them(sgl):
    text = (sgl / "__init__.py").read_text()
    assert 'Engine = LazyImport("sglang.srt.entrypoints.engine", "Engine")' in text
    assert "from sglang.version import __version__" in text   # the version guard reads it
    assert _class(sgl / "srt/server_args.py", "ServerArgs")


def test_every_engine_method_takes_the_arguments_the_backend_passes(sgl):
    methods = _methods(_class(sgl / "srt/entrypoints/engine.py", "Engine"))
    for name, passed in ENGINE_CALLS.items():
        assert name in methods, f"sglang.Engine has no {name}"
        args = methods[name].args
        params = [a.arg for a in args.args[1:] + args.kwonlyargs]
        assert set(passed) <= set(params), (name, set(passed) - set(params))
        required = params[:len(args.args) - 1 - len(args.defaults)]
        assert set(required) <= set(passed), (name, "needs", required)
    init = methods["__init__"].args
    assert init.kwarg is not None and init.kwarg.arg == "kwargs"   # Engine(**ServerArgs fields)


def test_the_backend_calls_nothing_else_on_the_engine():
    """Static check of sglang_backend.py: every self.engine.X(...) is in ENGINE_CALLS with
    keywords from its entry (the fake-engine test covers what arrives through **extra)."""
    tree = ast.parse((ROOT / "engine/generation/sglang/backend.py").read_text())
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "self.engine":
            seen.add(node.func.attr)
            assert node.func.attr in ENGINE_CALLS, node.func.attr
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            assert keywords <= set(ENGINE_CALLS[node.func.attr]), (node.func.attr, keywords)
    assert seen == set(ENGINE_CALLS)


def _server_args_fields(sgl: Path) -> set[str]:
    """ServerArgs' fields as 0.5.23 assembles them: the namespace Structs listed in
    _INPUT_NAMESPACES (each imported from srt.arg_groups.fields.*) plus its own annotations."""
    path = sgl / "srt/server_args.py"
    tree = _tree(path)
    origin = {a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom)
              for a in n.names}
    [namespaces] = [n.value for n in tree.body if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]) == "_INPUT_NAMESPACES"]
    fields = _fields(_class(path, "ServerArgs"))
    for name in (e.id for e in namespaces.elts):
        fields |= _fields(_class(_source(sgl, origin[name]), name))
    return fields


def test_server_args_has_every_field_the_backend_sets(sgl):
    fields = _server_args_fields(sgl)
    assert len(fields) > 300   # the namespaces were found
    assert set(SERVER_ARGS) <= fields, set(SERVER_ARGS) - fields
    # a msgspec Struct now, not a dataclass: record_field_names reads its __struct_fields__
    assert "ServerArgs = msgspec.defstruct(" in (sgl / "srt/server_args.py").read_text()


def test_sampling_params_and_seeding(sgl):
    sampling = _fields(_class(sgl / "srt/sampling/sampling_params.py", "SamplingParams"))
    assert set(SAMPLING_KEYS) <= sampling, set(SAMPLING_KEYS) - sampling
    # the seed reaches the sampler only in deterministic mode (unseeded rows get 42)
    batch = (sgl / "srt/sampling/sampling_batch_info.py").read_text()
    seeding = batch[batch.index("sampling_seed = ("):]
    assert re.search(r"else 42\s.*?if enable_deterministic\s+else None", seeding, re.S)
    assert "enable_deterministic = get_exec().deterministic.enable_deterministic_inference" \
        in batch
    choices = _tree(sgl / "srt/arg_groups/choices.py")
    [listed] = [ast.literal_eval(n.value) for n in choices.body if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "DETERMINISTIC_ATTENTION_BACKEND_CHOICES"]
    assert tuple(listed) == DETERMINISTIC_ATTENTION_BACKENDS
    assert not {"intel_amx", "torch_native"} & set(listed)   # the CPU backends: refused


def test_weight_updates_need_a_session_and_report_success(sgl):
    updater = sgl / "srt/managers/scheduler_components/weight_updater.py"
    methods = _methods(_class(updater, "SchedulerWeightUpdaterManager"))
    update = ast.unparse(methods["update_weights_from_tensor"])
    assert "if self._session is None" in update and "must run between" in update
    assert "success=False" in ast.unparse(methods["end_weight_update"])
    io = sgl / "srt/managers/io_struct.py"
    for name in ("UpdateWeightsFromTensorReqOutput", "BeginWeightUpdateReqOutput",
                 "EndWeightUpdateReqOutput", "FlushCacheReqOutput"):
        assert {"success", "message"} <= _fields(_class(io, name)), name


def test_outputs_memory_saver_and_deepseek_loader(sgl):
    manager = (sgl / "srt/managers/tokenizer_manager.py").read_text()
    for key in ('meta_info["output_token_logprobs"]', '"finish_reason":',
                'meta_info["routed_experts"]'):
        assert key in manager, key
    capturer = (sgl / "srt/state_capturer/routed_experts.py").read_text()
    assert "dtype=np.int32" in capturer   # decode_routed_experts reads int32
    exec_fields = _class(sgl / "srt/arg_groups/fields/exec_.py", "ExecFeatures")
    [saver] = [n for n in exec_fields.body if isinstance(n, ast.AnnAssign)
               and n.target.id == "enable_memory_saver"]
    assert ast.literal_eval(saver.value) is False   # the backend's default follows SGLang's
    adapter = (sgl / "srt/utils/torch_memory_saver_adapter.py").read_text()
    assert f"import {MEMORY_SAVER_PACKAGE}" in adapter
    [gpu] = [ast.literal_eval(v) for n in ast.walk(_tree(ROOT / "setup.py"))
             if isinstance(n, ast.Dict) for k, v in zip(n.keys, n.values)
             if isinstance(k, ast.Constant) and k.value == "gpu"]
    assert f"sglang=={TESTED_VERSION}" in gpu   # the gpu extra installs the tested release
    assert any(r.startswith(MEMORY_SAVER_PACKAGE) for r in gpu), gpu
    loader = _class(sgl / "srt/models/deepseek_common/deepseek_weight_loader.py",
                    "DeepseekV2WeightLoaderMixin")
    body = ast.unparse(_methods(loader)["do_load_weights"])   # the fused-half cache is local
    assert "cached_a_proj = {} if fuse_qkv_a_proj else None" in body
    assert sglang_settings.TESTED_VERSION == TESTED_VERSION


def test_deterministic_mode_has_no_cpu_attention_backend(sgl):
    """Why device cpu is refused (sglang_settings.device_problem), as SGLang resolves its
    arguments: the CPU hook sets intel_amx / torch_native before the deterministic hook, which
    raises for any backend outside DETERMINISTIC_ATTENTION_BACKEND_CHOICES."""
    pipeline = (sgl / "srt/arg_groups/pipeline.py").read_text()
    assert pipeline.index("run_hook(handle_cpu_backends, server_args)") < \
        pipeline.index("run_hook(handle_deterministic_inference, server_args)")
    cpu = ast.unparse([n for n in _tree(sgl / "srt/arg_groups/platform_hook.py").body
                       if isinstance(n, ast.FunctionDef) and n.name == "handle_cpu_backends"][0])
    assert "'torch_native' if is_host_cpu_arm64() else 'intel_amx'" in cpu
    [check] = [n for n in _tree(sgl / "srt/arg_groups/overrides.py").body
               if isinstance(n, ast.FunctionDef) and n.name == "_deterministic_attention_backend"]
    assert "elif view.attention_backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:\n" \
           "        raise ValueError(" in ast.unparse(check)
