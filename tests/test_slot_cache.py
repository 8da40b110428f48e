"""engine.generation.hf.slot_cache under a driver that stays busy, on tiny fp32 models on the CPU:
- positions: three request streams in four slots for 100 steps (the fourth slot free all along,
  rows repacked as the cache fills): a gpt2 model with 64 learned positions serves every
  request with `generate`'s tokens (before the fix the free slot's position passed 64: an
  IndexError at step 73), and on a Llama with longrope scaling (transformers picks the
  short or long factors from the batch's highest position; original 32) every request's
  log-probs equal `generate`'s within the driver's TOL while its own positions stay below 16
  (before the fix the free slot passed 32 and switched every row to the long factors);
- storage: a decode over the whole cache (what a compiled decoder gets) hands the step the
  layers' own key/value tensors (the objects transformers marked static), a windowed one views
  of them, and after every step the layers hold the same tensors at the same data pointers
  (before the fix the whole-cache step got fresh views, unmarked);
- a lone request's decode steps run SDPA unmasked with grouped KV heads (the eager loop's
  kernel call: no mask, no key/value repeat) and equal `generate` within TOL; with two rows
  the mask is back, and the layers are compileable again after every step (before the fix
  every lone step was masked over a bucketed window, with repeated keys/values);
- the StaticLayer probe passes on the installed transformers and names a changed field.
"""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import StaticLayer

from engine.generation.base import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.hf.cache_probe import static_layer_problem
from engine.generation.hf.static_decode import StaticDecoder
from engine.generation.hf.stepper import HFStepDriver
from tools.tiny_models import build_tiny_model, build_tokenizer

TOL = 5e-6        # tests/test_hf_stepper.py's
STEPS = 100       # > 64 (gpt2's positions) and > 32 (longrope's original length) + its rows'
STARTS = (0, 4, 8)   # three streams, staggered: four slots, one of them free all along
NEW = 12          # prompt 4 + 12 tokens: every row's positions stay below 16


def rotate(driver, steps: int = STEPS) -> dict:
    """Stream s adds its next request (prompt [5 + s, 6, 7, 8] shifted by its count, NEW
    tokens, greedy or seeded in turn) whenever it has none running, from step STARTS[s];
    key -> (prompt, SamplingParams, Generation) of every request finished in `steps` steps, and
    the highest position a free slot held after a step."""
    running, done, n, free_pos = {}, {}, 0, 0
    for k in range(steps):
        for s, start in enumerate(STARTS):
            if k >= start and s not in running:
                n += 1
                prompt = [5 + s + n % 7, 6, 7, 8 + n % 5]
                p = SamplingParams(max_new_tokens=NEW, temperature=(n % 2) * 1.0,
                                   seeds=[n])
                running[s] = (f"r{n}", prompt, p)
                driver.add(f"r{n}", prompt, p)
        for out in driver.step():
            if out.done is not None:
                s = next(s for s, (key, _, _) in running.items() if key == out.key)
                _, prompt, p = running.pop(s)
                done[out.key] = (prompt, p, out.done)
        assert driver.layout.slots <= 4
        free = [s for s in range(driver.layout.slots) if s not in driver.layout.left]
        free_pos = max([free_pos] + [int(driver.layout.pos[s]) for s in free])
    return done, free_pos


def worst_diff(engine, done: dict) -> float:
    """Tokens equal `generate`'s of each request alone; the largest log-prob difference."""
    worst = 0.0
    for prompt, p, got in done.values():
        (ref,) = engine.generate([prompt], p)
        assert got.response_ids == ref.response_ids
        worst = max([worst] + [abs(a - b) for a, b in zip(got.response_logprobs,
                                                           ref.response_logprobs)])
    return worst


def test_learned_positions_survive_a_busy_driver(tmp_path):
    """gpt2, n_positions 64: 100 steps of three streams run (the free slot stays at 0)."""
    path = str(tmp_path / "gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=200, n_positions=64,
                               eos_token_id=3, bos_token_id=3, pad_token_id=0)
                    ).save_pretrained(path)
    build_tokenizer(path, 200)
    engine = HFRolloutEngine(path, device="cpu")
    done, free_pos = rotate(HFStepDriver(engine))
    assert len(done) >= 3 * (STEPS - 8) // (NEW + 1)
    assert worst_diff(engine, done) <= TOL
    assert free_pos == 0


def test_longrope_rows_keep_their_own_factors(tmp_path):
    """Llama with longrope (original 32, long factors 4x the short ones): every request of
    100 steps of three streams equals `generate` alone within TOL."""
    path = build_tiny_model(
        str(tmp_path / "longrope"), "llama", hidden=32, layers=2, heads=4, kv_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                         "original_max_position_embeddings": 32})
    engine = HFRolloutEngine(path, device="cpu")
    assert engine.model.config.rope_parameters["rope_type"] == "longrope"
    done, free_pos = rotate(HFStepDriver(engine))
    assert len(done) >= 3 * (STEPS - 8) // (NEW + 1)
    assert worst_diff(engine, done) <= TOL
    assert free_pos == 0


class Spy(StaticDecoder):
    """An eager StaticDecoder that decodes over the whole cache, as a compiled one does
    (SlotCache.window), and records what each layer holds during each step."""

    def __init__(self, engine, whole: bool) -> None:
        super().__init__(engine.model, "past_key_values", False, engine.device)
        self.compile = whole   # the window's rule only: `_step` stays the eager forward
        self.seen: list[list[tuple]] = []

    def step(self, input_ids, mask, positions, cache):
        self.seen.append([(layer.keys, layer.values) for layer in cache.layers])
        return super().step(input_ids, mask, positions, cache)

    def release(self) -> None:
        """Keeps the caches (the test reads their storage)."""


@pytest.mark.parametrize("whole", [True, False])
def test_decode_keeps_the_layers_tensors(tmp_path, whole):
    """Two requests of up to 80 tokens, the second joining at step 3: the layers keep their own
    tensors (identity and data pointers) through every step; with the whole cache every step
    sees those tensors themselves, marked static; with a window, some steps get views into
    their storage."""
    path = build_tiny_model(str(tmp_path / "llama"), "llama", hidden=32, layers=2, heads=4,
                            kv_heads=2)
    engine = HFRolloutEngine(path, device="cpu")
    driver = HFStepDriver(engine)
    spy = driver.layout.decoder = Spy(engine, whole)
    p = SamplingParams(max_new_tokens=80, temperature=0.0)   # a cache longer than a window
    driver.add("a", [5, 6, 7], p)
    owned, k = None, 0
    while driver.busy:
        if k == 3:
            driver.add("b", [9, 10, 11, 12, 13], p)
        driver.step()
        k += 1
        if driver.layout.cache is not None and driver.layout.cache.layers[0].is_initialized:
            layers = driver.layout.cache.layers
            now = [(l.keys, l.values, l.keys.data_ptr(), l.values.data_ptr()) for l in layers]
            if owned is not None and driver.layout.slots == owned[0]:
                assert all(a[0] is b[0] and a[1] is b[1] and a[2:] == b[2:]
                           for a, b in zip(now, owned[1]))
            owned = (driver.layout.slots, now)
    assert len(spy.seen) > 10   # both requests decoded, the second after a repack
    storage = {t.untyped_storage().data_ptr()
               for layer in driver.layout.decoder._caches.values()
               for l in layer.layers for t in (l.keys, l.values)}
    views = 0   # steps that got views (not the marked tensors)
    for seen in spy.seen:
        for keys, values in seen:
            assert {keys.untyped_storage().data_ptr(),
                    values.untyped_storage().data_ptr()} <= storage
        views += not all(hasattr(t, "_dynamo_static_input_type") for kv in seen for t in kv)
    assert views == 0 if whole else views > 0


def test_a_lone_row_decodes_as_the_eager_loop(tmp_path, monkeypatch):
    path = build_tiny_model(str(tmp_path / "llama"), "llama", hidden=32, layers=2, heads=4,
                            kv_heads=2)
    engine = HFRolloutEngine(path, device="cpu")
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if q.shape[2] == 1:   # decode steps only
            calls.append((attn_mask is None, kw.get("enable_gqa", False), k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    p = SamplingParams(max_new_tokens=30, temperature=1.0, seeds=[3])
    (ref,) = engine.generate([[5, 6, 7, 8]], p)
    assert len(ref.response_ids) == 30
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    driver = HFStepDriver(engine)
    driver.add("a", [5, 6, 7, 8], p)
    while driver.busy:
        out = driver.step()
        assert all(layer.is_compileable for layer in driver.layout.cache.layers) \
            if driver.layout.cache is not None else True
    got = out[0].done
    assert got.response_ids == ref.response_ids
    assert max(abs(a - b) for a, b in zip(got.response_logprobs, ref.response_logprobs)) <= TOL
    assert calls == [(True, True, 2)] * (2 * 29)   # 29 decode steps x 2 layers, 2 KV heads
    calls.clear()
    driver.add("a", [5, 6, 7, 8], p)
    driver.add("b", [9, 10], p)
    while driver.busy:
        driver.step()
    # two rows: masked, the 2 KV heads still shared in place (engine.generation.hf.gqa_attention)
    assert calls and all(c == (False, True, 2) for c in calls)


class Misplaced(StaticLayer):
    """A StaticLayer whose update writes one column further than `cumulative_length`."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length.add_(1)
        return super().update(key_states, value_states, *args, **kwargs)


class Copying(StaticLayer):
    """A StaticLayer whose update replaces its tensors (no longer in place)."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values = self.keys.clone(), self.values.clone()
        return super().update(key_states, value_states, *args, **kwargs)


class Unmarked(StaticLayer):
    """A StaticLayer that no longer marks its tensors static."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.keys, self.values = self.keys.clone(), self.values.clone()


def test_static_layer_probe_names_a_changed_field():
    assert static_layer_problem() is None
    assert "update no longer writes the column" in static_layer_problem(Misplaced)
    assert "in place" in static_layer_problem(Copying)
    assert "marks `keys` static" in static_layer_problem(Unmarked)
