"""`serve` speaks vLLM's sampling fields (engine.api.sampling_fields: top_k, min_p,
repetition_penalty, presence_penalty, frequency_penalty, logit_bias, ignore_eos, min_tokens,
stop_token_ids) on both backends, checked against independent references on one tiny Llama
(32-dim heads: vLLM's CPU attention needs them; its eos logit raised so replies end early and
min_tokens / ignore_eos / stop_token_ids have something to change):

- vllm backend: every field, greedy and seeded, gives the tokens and finish_reason of vLLM's
  own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, started once for the
  module) on the same folder;
- hf backend: greedy gives vLLM's server's tokens; seeded gives the tokens of a plain loop over
  transformers' own logits processors (MinNewTokensLength, SequenceBias, RepetitionPenalty,
  Temperature, MinP, TopK, TopP; presence / frequency by OpenAI's formula, which transformers
  lacks) and the engine's documented draw (inverse CDF at u(seed, t));
- requests with different fields sent at once (one running batch) get their replies alone;
- every case changes the reply of the same request without the field (the field is not
  ignored: negative control), and the reported log-probs are the raw scores whatever the
  fields (vLLM's raw_logprobs); each engine's own sampling log-probs keep the contract of
  engine.generation.base (the unshaped logits) under fields.

Requests go through the openai client with `extra_body` (as evaluation harnesses send them).
Slow (two vLLM engines and an hf engine start): second tier.
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from engine.generation.sampling import inverse_cdf, uniforms
from engine.generation.sampling_backend import StepBackend
from engine.serve.endpoint import ServeEndpoint, ServeSettings
from tools.tiny_models import build_eos_model

PROMPT = [12, 40, 7, 23, 55, 9]
MAX_TOKENS, MAX_CONTEXT, SEED, EOS = 24, 256, 11, 3
CASES = {
    "repetition_penalty": dict(repetition_penalty=1.6),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=1.2),
    "top_k": dict(top_k=3),
    "min_p": dict(min_p=0.3),
    "logit_bias": dict(logit_bias={"7": 6.0, "57": -100}),
    "min_tokens": dict(min_tokens=20),
    "ignore_eos": dict(ignore_eos=True),
    "stop_token_ids": dict(stop_token_ids=[59, 35]),   # the 5th and 7th greedy ids
    "all together": dict(top_k=20, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                         frequency_penalty=0.2, logit_bias={"9": 1.5}, min_tokens=4,
                         stop_token_ids=[30]),
}
MODES = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.9, top_p=0.95,
                                                         seed=SEED)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_server(path: str, log_path: str):
    """vLLM's own OpenAI server on `path` (float32, eager); (process, base url)."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--served-model-name",
         "tiny", "--max-model-len", str(MAX_CONTEXT), "--seed", "0"],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    return proc, url


def _wait(proc, url: str, log_path: str, limit_s: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited: {open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("vLLM's server did not start")


def _serve(loaded, driver):
    """An in-process serve endpoint over `driver` on an owner thread; (endpoint, stop)."""
    endpoint = ServeEndpoint(loaded.tokenizer, ServeSettings("tiny", MAX_TOKENS, MAX_CONTEXT),
                             request_log=None).start()
    stop = threading.Event()
    threading.Thread(target=endpoint.serve, args=(StepBackend(driver), stop.is_set),
                     daemon=True).start()
    return endpoint, stop


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"vllm server", "serve vllm", "serve hf"}: base URLs, and the model folder."""
    from engine.generation.hf.stepper import HFStepDriver
    from engine.generation.vllm.stepper import VLLMStepDriver
    from engine.serve.model import load_model

    root = tmp_path_factory.mktemp("serve_sampling")
    path = build_eos_model(str(root / "llama"), hidden=128, eos_boost=4.0)
    log = str(root / "vllm_server.log")
    proc, vllm_url = _vllm_server(path, log)    # starts while the engines below load
    try:
        on_vllm = load_model(path, "vllm", "float32", 0, MAX_CONTEXT, enforce_eager=True)
        on_hf = load_model(path, "hf", "float32", 0, MAX_CONTEXT)
        serve_vllm, stop_v = _serve(on_vllm, VLLMStepDriver(on_vllm.engine, logprobs=False))
        serve_hf, stop_h = _serve(on_hf, HFStepDriver(on_hf.engine))
        _wait(proc, vllm_url, log)
        yield {"vllm server": vllm_url, "serve vllm": serve_vllm.base_url,
               "serve hf": serve_hf.base_url, "path": path,
               "engines": {"vllm": on_vllm.engine, "hf": on_hf.engine}}
        for stop, endpoint in ((stop_v, serve_vllm), (stop_h, serve_hf)):
            stop.set()
            endpoint.stop()
        on_vllm.engine.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _complete(url: str, fields: dict, mode: dict, logprobs: bool = False) -> dict:
    """token ids, finish_reason and (logprobs) the sampled tokens' log-probs of one completion
    of PROMPT."""
    base = url if url.endswith("/v1") else url + "/v1"
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
    extra = {k: v for k, v in fields.items() if k not in ("presence_penalty",
                                                           "frequency_penalty", "logit_bias")}
    kwargs = {k: fields[k] for k in ("presence_penalty", "frequency_penalty", "logit_bias")
              if k in fields}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=0 if logprobs else None,
        extra_body={**extra, "return_token_ids": True}, **kwargs, **mode)
    choice = out.choices[0]
    return {"ids": list(choice.token_ids), "finish": choice.finish_reason,
            "logprobs": choice.logprobs.token_logprobs if logprobs else None}


@pytest.fixture(scope="module")
def replies(servers):
    """(server, case, mode) -> reply, for every case (and "neutral") on every server."""
    out = {}
    for case, fields in {"neutral": {}, **CASES}.items():
        for mode_name, mode in MODES.items():
            for server in ("vllm server", "serve vllm", "serve hf"):
                out[server, case, mode_name] = _complete(servers[server], fields, mode)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_vllm_backend_equals_vllms_own_server(replies, mode):
    """serve --backend vllm samples what vLLM's server samples, field by field."""
    for case in ["neutral", *CASES]:
        ours, theirs = replies["serve vllm", case, mode], replies["vllm server", case, mode]
        assert (ours["ids"], ours["finish"]) == (theirs["ids"], theirs["finish"]), case


def test_hf_backend_greedy_equals_vllms_own_server(replies):
    for case in ["neutral", *CASES]:
        ours, theirs = replies["serve hf", case, "greedy"], replies["vllm server", case, "greedy"]
        assert (ours["ids"], ours["finish"]) == (theirs["ids"], theirs["finish"]), case


@functools.lru_cache(maxsize=1)
def _reference_model(path: str):
    """The folder in transformers (float32, eval), loaded once for every reference case."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference(path: str, fields: dict, mode: dict) -> tuple[list[int], str]:
    """The hf reference loop (module docstring): full forwards, transformers' processors in
    vLLM's order, the engine's inverse-CDF draw at u(SEED, t)."""
    from transformers.generation import logits_process as lp

    model = _reference_model(path)
    eos = {EOS}
    stops = set(fields.get("stop_token_ids", [])) | (set() if fields.get("ignore_eos") else eos)
    procs = []
    if fields.get("min_tokens"):
        procs.append(lp.MinNewTokensLengthLogitsProcessor(
            len(PROMPT), fields["min_tokens"], sorted(eos | set(fields.get("stop_token_ids", [])))))
    if fields.get("logit_bias"):
        procs.append(lp.SequenceBiasLogitsProcessor(
            [[[int(k)], float(v)] for k, v in fields["logit_bias"].items()]))
    if fields.get("repetition_penalty"):
        procs.append(lp.RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    warpers = [lp.TemperatureLogitsWarper(mode["temperature"])]
    if fields.get("min_p"):
        warpers.append(lp.MinPLogitsWarper(fields["min_p"]))
    if fields.get("top_k"):
        warpers.append(lp.TopKLogitsWarper(fields["top_k"]))
    warpers.append(lp.TopPLogitsWarper(mode["top_p"]))
    ids = list(PROMPT)
    for t in range(MAX_TOKENS):
        x = torch.tensor([ids])
        with torch.no_grad():
            scores = model(x).logits[:, -1].float()
        for p in procs:
            scores = p(x, scores)
        counts = torch.bincount(torch.tensor(ids[len(PROMPT):], dtype=torch.long),
                                minlength=scores.shape[-1]).float()   # OpenAI's formula
        scores = scores - fields.get("frequency_penalty", 0.0) * counts \
            - fields.get("presence_penalty", 0.0) * (counts > 0).float()
        for w in warpers:
            scores = w(x, scores)
        u = uniforms(torch.tensor([SEED]), t, 1)[:, 0]
        token = int(inverse_cdf(torch.softmax(scores, dim=-1), u))
        ids.append(token)
        if token in stops:
            return ids[len(PROMPT):], "stop"
    return ids[len(PROMPT):], "length"


def test_hf_backend_seeded_equals_transformers_processors(servers, replies):
    for case, fields in {"neutral": {}, **CASES}.items():
        ours = replies["serve hf", case, "seeded"]
        assert (ours["ids"], ours["finish"]) == _reference(servers["path"], fields,
                                                           MODES["seeded"]), case


def test_every_field_changes_the_reply(replies):
    """Negative control: each case's replies differ from the neutral request's on every
    server (in at least one mode), so none of the comparisons above is vacuous."""
    for server in ("vllm server", "serve vllm", "serve hf"):
        for case in CASES:
            changed = [replies[server, case, m]["ids"] != replies[server, "neutral", m]["ids"]
                       for m in MODES]
            assert any(changed), (server, case)


def test_reported_logprobs_ignore_the_fields(servers):
    """The reply's log-probs are the raw scores (vLLM's raw_logprobs): a token sampled under
    a logit bias of +6 reports the same log-prob as scoring that sequence without it; on hf
    and vllm alike, and equal to vLLM's server's."""
    fields, mode = CASES["logit_bias"], MODES["greedy"]
    got = {s: _complete(servers[s], fields, mode, logprobs=True)
           for s in ("vllm server", "serve vllm", "serve hf")}
    assert got["serve hf"]["ids"] == got["vllm server"]["ids"]
    for server in ("serve vllm", "serve hf"):
        diff = max(abs(a - b) for a, b in zip(got[server]["logprobs"],
                                              got["vllm server"]["logprobs"]))
        assert diff < 2e-4, (server, diff)
    biased = [i for i, t in enumerate(got["serve hf"]["ids"]) if t == 7]
    assert biased and all(got["serve hf"]["logprobs"][i] < -0.5 for i in biased)


def test_mixed_fields_in_one_batch_equal_each_alone(servers, replies):
    """Every case sent at once (one running batch of rows with different fields, and a row
    without any) gives each request's reply alone, on both backends: rows are shaped on their
    own."""
    from concurrent.futures import ThreadPoolExecutor

    cases = {"neutral": {}, **CASES}
    for server in ("serve vllm", "serve hf"):
        with ThreadPoolExecutor(len(cases)) as pool:
            got = dict(zip(cases, pool.map(
                lambda f: _complete(servers[server], f, MODES["seeded"]), cases.values())))
        for case in cases:
            assert got[case]["ids"] == replies[server, case, "seeded"]["ids"], (server, case)


def test_sampling_logprobs_keep_the_contract(servers):
    """Each engine's `generate` under fields (the engines are idle between requests): the
    sampled ids' log-probs are log_softmax(logits / T) of the UNSHAPED logits, at T = 1 the
    raw scores of the same ids, although the bias and penalties moved the draw (negative
    control: vLLM's sampler hands its contract wrapper the shaped logits; without
    vllm.worker.keep_unshaped the vllm engine reports those)."""
    from engine.api.sampling_fields import SamplingFields
    from engine.generation.base import SamplingParams

    fields = SamplingFields(logit_bias=((57, 8.0),), repetition_penalty=1.6,
                            presence_penalty=1.0, min_tokens=8)
    for name, engine in servers["engines"].items():
        params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, seeds=[SEED],
                                sampling=[fields])
        (gen,) = engine.generate([PROMPT], params)
        (scores,) = engine.score([PROMPT + gen.response_ids], 0)
        raw = scores.logprobs[len(PROMPT) - 1:]
        assert 57 in gen.response_ids and len(gen.response_ids) > 8, name
        diff = max(abs(a - b) for a, b in zip(gen.response_logprobs, raw))
        assert diff < 2e-4, (name, diff)
