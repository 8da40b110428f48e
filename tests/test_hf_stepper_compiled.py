"""engine.generation.hf.stepper.HFStepDriver over an engine with rollout.hf.compile on (CPU,
a tiny fp32 Llama): the driver decodes with the engine's own compiled StaticDecoder step (a
compilation for its slot-cache shape: second tier, about 10 s cold) and samples what the
engine's `generate` samples (tokens equal, log-probs within the static path's tolerance)."""
from __future__ import annotations

from engine.generation.base import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.hf.stepper import HFStepDriver
from tools.tiny_models import build_eos_model

TOL = 3e-6   # tests/test_hf_rollout_static.py (12-token replies, as here)


def test_the_driver_decodes_with_the_compiled_step(tmp_path):
    path = build_eos_model(str(tmp_path / "llama"), eos_boost=-3.0)
    compiled = HFRolloutEngine(path, device="cpu", static_cache=True, compile=True)
    driver = HFStepDriver(compiled)
    assert driver.layout.decoder is compiled.decoder and not driver.own_decoder
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seeds=[4])
    ref = compiled.generate([[5, 6, 7]], p)[0]
    calls, step = [], compiled.decoder.step   # the decoder's (compiled) step, counted from here

    def counted(*args):
        calls.append(args[0].shape[0])
        return step(*args)

    compiled.decoder.step = counted
    driver.add("k", [5, 6, 7], p)
    done = []
    while driver.busy:
        done += [o.done for o in driver.step() if o.done is not None]
    (got,) = done
    assert got.response_ids == ref.response_ids and len(got.response_ids) == 12
    assert max(abs(a - b) for a, b in zip(got.response_logprobs, ref.response_logprobs)) <= TOL
    # the driver's 11 decode steps (the first token comes from the prefill) ran the compiled
    # step on its slot cache: one slot (slot_cache.MIN_SLOTS) x 64 columns
    assert calls == [1] * 11 and (1, 64) in compiled.decoder.shapes
