"""engine.generation.steps.aborted_on_error, the abort-on-exit every user of a step driver runs
under (vLLM rounds, the partial driver session, StepServing; on vLLM itself:
tests/test_vllm_failures.py, second tier): on an exception it aborts exactly the requests the
block added that did not finish, leaves the ones held before the block, raises the block's
error again (an abort that fails too becomes a note on it), and does nothing on a clean exit.
Over the hf step driver and over StepBackend too. No engine but a tiny hf one."""
from __future__ import annotations

import pytest
import torch

from engine.api.backend import GenerateRequest
from engine.generation import SamplingParams
from engine.generation.steps import aborted_on_error


class Driver:
    """A step driver's bookkeeping: `in_flight`, `abort` (recorded); `finish(key)`."""

    def __init__(self, held=()) -> None:
        self.keys, self.aborted = set(held), []

    def in_flight(self) -> set[str]:
        return set(self.keys)

    def add(self, key: str) -> None:
        self.keys.add(key)

    def finish(self, key: str) -> None:
        self.keys.discard(key)

    def abort(self, key: str) -> None:
        self.aborted.append(key)
        self.keys.discard(key)


def test_a_failed_block_aborts_what_it_added_and_did_not_finish():
    d = Driver(held=["old"])
    with pytest.raises(RuntimeError, match="step failed"):
        with aborted_on_error(d):
            for key in ("0", "1", "2"):
                d.add(key)
            d.finish("1")
            raise RuntimeError("step failed")
    assert d.aborted == ["0", "2"] and d.keys == {"old"}
    clean = Driver()
    with aborted_on_error(clean):
        clean.add("0")
    assert clean.aborted == [] and clean.keys == {"0"}   # a clean exit aborts nothing


def test_an_abort_that_fails_is_a_note_on_the_blocks_error():
    class Dead(Driver):
        def abort(self, key):
            raise OSError("engine gone")

    d = Dead()
    with pytest.raises(RuntimeError, match="step failed") as info:
        with aborted_on_error(d):
            d.add("0")
            raise RuntimeError("step failed")
    assert info.value.__notes__ == ["aborting request '0' failed too: OSError: engine gone"]


def test_the_hf_step_driver_and_step_backend_are_emptied(tmp_path):
    from engine.generation.hf.backend import HFRolloutEngine
    from engine.generation.hf.stepper import HFStepDriver
    from engine.generation.sampling_backend import StepBackend
    from tools.tiny_models import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), "qwen3", layers=1, heads=4)
    driver = HFStepDriver(HFRolloutEngine(path, dtype=torch.float32))
    params = SamplingParams(max_new_tokens=8, seeds=[1])
    with pytest.raises(RuntimeError, match="injected"):
        with aborted_on_error(driver):
            driver.add("a", [5, 6, 7], params, stream=True)
            driver.add("b", [8, 9], params)
            driver.step()
            assert driver.in_flight() == {"a", "b"}
            raise RuntimeError("injected")
    assert driver.in_flight() == set() and not driver.busy
    assert [e[:2] for e in driver.events if e[0] == "aborted"] == [("aborted", "a"),
                                                                    ("aborted", "b")]
    backend = StepBackend(driver)
    with pytest.raises(RuntimeError, match="injected"):
        with backend.aborted_on_error():
            backend.add("c", GenerateRequest((5, 6), 8, 1.0, 1.0, 3, score_top_k=2))
            backend.step()
            raise RuntimeError("injected")
    assert backend.in_flight() == set() and not driver.busy
