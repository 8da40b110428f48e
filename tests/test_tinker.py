"""`megatron-sft-engine tinker` (engine.tinker) driven by the official `tinker` SDK (0.38,
unmodified) on a tiny locally built Llama (tools.tiny_models.build_eos_model: hidden 32, 2
layers, vocab 200; nothing is downloaded). One server for the module: the command as
engine.tinker.__main__.build makes it, run on a thread of this process and driven over HTTP,
with two API keys of two owners. Covered: capabilities, two LoRA models, forward_backward with
cross_entropy / importance_sampling / ppo, optim_step, save_weights_and_get_sampling_client,
sample, compute_logprobs, save_state and a fresh client resuming with the optimizer;
cross_entropy + optim_step equal to an independent reference (transformers + peft LoRA + torch
AdamW) over 3 steps; two models batched together equal the same models trained alone, a third
untouched; another owner's ids are 404; bad input is a 4xx naming the field, and a refusal
logs nothing; a failing request in a batch fails only its own future; a second server on the
same --state-dir serves the saved state; the console command refuses a bad flag by name."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.launch import free_port  # noqa: E402
from tools.tiny_models import build_eos_model  # noqa: E402

KEY_A, KEY_B = "tml-owner-a", "tml-owner-b"
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01,
            grad_clip_norm=0.0)


def _serve(argv: list[str]) -> dict:
    """The command (`megatron-sft-engine tinker ARGV`) as engine.tinker.__main__.build makes
    it, run on a thread of this process and driven over HTTP; returns its url, service and a
    stop()."""
    from engine.tinker.__main__ import build

    port = free_port()
    web = build([*argv, "--port", str(port)])
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        assert thread.is_alive(), "the server stopped while starting"
        time.sleep(0.02)

    def stop():
        web.should_exit = True
        thread.join(timeout=30)
    return dict(url=f"http://127.0.0.1:{port}", service=web.config.app.state.service, stop=stop)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker")
    model = build_eos_model(str(root / "llama"))
    keys = root / "keys"
    keys.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")
    argv = ["--model", model, "--keys-file", str(keys), "--state-dir", str(root / "state"),
            "--max-body-mb", "1", "--batch-wait-ms", "50"]
    info = dict(_serve(argv), model=model, root=root, argv=argv)
    yield info
    info["stop"]()


def _client(server, key=KEY_A) -> "tinker.ServiceClient":
    return tinker.ServiceClient(base_url=server["url"], api_key=key)


def _datum(tokens, targets, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, **inputs})


SFT = [_datum([5, 6, 7, 8, 9], [6, 7, 8, 9, 10], weights=[0, 1, 1, 1, 1]),
       _datum([11, 12, 13], [12, 13, 14], weights=[1, 1, 1])]


def test_sdk_trains_samples_saves_and_resumes(server):
    sc = _client(server)
    caps = tinker.RestClient(base_url=server["url"], api_key=KEY_A).get_server_capabilities() \
        .result()
    assert [m.model_name for m in caps.supported_models] == ["llama"]
    tc = sc.create_lora_training_client(base_model="llama", rank=4, seed=3).result()
    other = sc.create_lora_training_client(base_model="llama", rank=2, seed=4,
                                           train_unembed=False).result()
    assert other.get_info().lora_rank == 2 and tc.model_id != other.model_id
    losses = []
    for _ in range(3):
        out = tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        losses.append(out.metrics["loss:sum"])
        lp = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
        # loss:sum is -(weights * logprobs).sum() over the datums, as the SDK documents
        w = [np.array([0, 1, 1, 1, 1.]), np.ones(3)]
        assert out.metrics["loss:sum"] == pytest.approx(-sum((a * b).sum() for a, b in
                                                             zip(lp, w)), rel=1e-6)
    assert losses[2] < losses[1] < losses[0]
    # importance_sampling and ppo on the current policy's own log-probs: ratio 1, so the loss
    # is -sum(advantages) and ppo's clip is inactive
    fwd = tc.forward(SFT[:1], "cross_entropy").result()
    old = fwd.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()
    adv = [0.5, -1.0, 2.0, 0.0, 1.0]
    rl = [_datum([5, 6, 7, 8, 9], [6, 7, 8, 9, 10], logprobs=old, advantages=adv)]
    for loss_fn in ("importance_sampling", "ppo"):
        out = tc.forward_backward(rl, loss_fn).result()
        assert out.metrics["loss:sum"] == pytest.approx(-sum(adv), rel=1e-5), loss_fn
    tc.optim_step(types.AdamParams(**ADAM)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=1)).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert seq.stop_reason in ("stop", "length") and 1 <= len(seq.tokens) <= 6
        assert len(seq.logprobs) == len(seq.tokens)
        if seq.stop_reason == "length":
            assert len(seq.tokens) == 6
    # compute_logprobs is the exact forward: its log-probs equal forward's on the same tokens
    full = [5, 6, 7, 8, 9, 10]
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    fwd = tc.forward([_datum(full[:-1], full[1:])], "cross_entropy").result()
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               rtol=1e-6)
    # a greedy sample's log-probs are compute_logprobs' of the same continuation
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0,
                                                            stop=[])).result().sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7, *greedy.tokens]))
    np.testing.assert_allclose(greedy.logprobs, scored.result()[3:], rtol=1e-5)
    # save_state, then a fresh client resumes with the optimizer: its next step equals the
    # original client's next step
    path = tc.save_state("resume").result().path
    resumed = _client(server).create_training_client_from_state_with_optimizer(path).result()
    a = tc.forward_backward(SFT, "cross_entropy").result()
    b = resumed.forward_backward(SFT, "cross_entropy").result()
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    ga = tc.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    gb = resumed.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    assert ga == gb
    after = [c.forward(SFT, "cross_entropy").result().metrics["loss:sum"] for c in (tc, resumed)]
    assert after[0] == after[1]
    # without the optimizer state (create_training_client_from_state) the next step differs
    fresh = _client(server).create_training_client_from_state(path).result()
    fresh.forward_backward(SFT, "cross_entropy").result()
    fresh.optim_step(types.AdamParams(**ADAM)).result()
    assert fresh.forward(SFT, "cross_entropy").result().metrics["loss:sum"] != after[0]


def peft_with_adapter(model_dir: str, adapter: dict, targets: list[str], rank: int = 4,
                      alpha: float = 32.0):
    """transformers + peft LoRA (`rank`, `alpha`, `targets`) on `model_dir` with the service's
    adapter (names "model.layers.0.self_attn.q_proj.A" / ".B") copied in: (the peft model,
    {service name: its peft parameter}); every service matrix lands in exactly one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                            target_modules=targets))
    params = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            path = name.replace("base_model.model.", "")
            for kind, layer in (("A", module.lora_A), ("B", module.lora_B)):
                layer["default"].weight.data.copy_(adapter[f"{path}.{kind}"])
                params[f"{path}.{kind}"] = layer["default"].weight
    assert sorted(params) == sorted(adapter), sorted(set(params) ^ set(adapter))[:4]
    return model, params


def _reference_steps(model_dir: str, adapter: dict, steps: int) -> tuple[list, dict]:
    """The same SFT steps without the service: transformers + peft LoRA (r 4, alpha 32) with
    the service's initial adapter copied in, torch AdamW with ADAM."""
    model, params = peft_with_adapter(model_dir, adapter, [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    opt = torch.optim.AdamW(list(params.values()), lr=ADAM["learning_rate"],
                            betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"])
    losses = []
    for _ in range(steps):
        total = 0
        for d in SFT:
            ids = torch.tensor([d.model_input.to_ints()])
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
            t = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            w = torch.tensor(d.loss_fn_inputs["weights"].to_numpy())
            total = total - (logp.gather(-1, t[:, None])[:, 0] * w).sum()
        total.backward()
        losses.append(float(total))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in params.items()}


def _state(server, path: str) -> dict:
    from urllib.parse import quote
    model_id, _, rest = path[len("tinker://"):].partition("/")
    kind, _, name = rest.partition("/")
    return torch.load(server["root"] / "state" / quote(model_id, safe="") / kind /
                      f"{quote(name, safe='')}.pt", weights_only=True)


def test_cross_entropy_steps_equal_peft_and_torch_adamw(server):
    tc = _client(server).create_lora_training_client(base_model="llama", rank=4, seed=7).result()
    start = _state(server, tc.save_state("start").result().path)["adapter"]
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward(SFT, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(**ADAM)).result()
    end = _state(server, tc.save_state("end").result().path)["adapter"]
    ref_losses, ref_params = _reference_steps(server["model"], start, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in ref_params.items():
        torch.testing.assert_close(end[k], v, rtol=1e-5, atol=1e-6)


def _train(tc, data, steps=2) -> list:
    out = []
    for _ in range(steps):
        r = tc.forward_backward(data, "cross_entropy").result()
        out.append((r.metrics["loss:sum"], [o["logprobs"].to_numpy() for o in r.loss_fn_outputs]))
        tc.optim_step(types.AdamParams(**ADAM)).result()
    return out


def test_two_models_batched_equal_each_alone_bitwise_third_untouched(server):
    """Two models trained interleaved, each step's two forward_backward requests run as one
    batch (2 + 1 rows, padded to 7 tokens), equal the same models trained alone (2 rows padded
    to 5; 1 row): losses, per-token log-probs and the adapters after 2 steps, bit for bit
    (engine.tinker.lora: batch invariance). A third model's adapter is untouched."""
    sc = _client(server)
    data_x, data_y = SFT, [_datum([20, 21, 22, 23, 24, 25, 26], [21, 22, 23, 24, 25, 26, 27])]
    make = lambda seed: sc.create_lora_training_client(base_model="llama", rank=4,  # noqa
                                                       seed=seed).result()
    x, y, z = make(11), make(12), make(13)
    z_start = _state(server, z.save_state("z0").result().path)["adapter"]
    together, rows = {}, {}

    def run(name, tc, data):
        out = []
        for _ in range(2):
            barrier.wait()
            r = tc.forward_backward(data, "cross_entropy").result()
            rows.setdefault(name, []).append(r.metrics["batch_rows:max"])
            out.append((r.metrics["loss:sum"],
                        [o["logprobs"].to_numpy() for o in r.loss_fn_outputs]))
            tc.optim_step(types.AdamParams(**ADAM)).result()
        together[name] = out
    barrier = threading.Barrier(2)
    service = server["service"]
    wait, service.batch_wait_s = service.batch_wait_s, 0.5   # both requests land in the window
    try:
        threads = [threading.Thread(target=run, args=a)
                   for a in (("x", x, data_x), ("y", y, data_y))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        service.batch_wait_s = wait
    assert rows == {"x": [3.0, 3.0], "y": [3.0, 3.0]}   # every step ran as one batch
    x1, y1 = make(11), make(12)
    alone = {"x": _train(x1, data_x), "y": _train(y1, data_y)}
    for name in ("x", "y"):
        for (la, lpa), (lb, lpb) in zip(together[name], alone[name]):
            assert la == lb, name
            for a, b in zip(lpa, lpb):
                assert np.array_equal(a, b), (name, a, b)
    for a, b in ((x, x1), (y, y1)):
        sa = _state(server, a.save_state("after").result().path)["adapter"]
        sb = _state(server, b.save_state("after").result().path)["adapter"]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    z_end = _state(server, z.save_state("z1").result().path)["adapter"]
    assert all(torch.equal(z_start[k], z_end[k]) for k in z_start)


def test_cispo_dro_and_gspo_equal_their_documented_formulas(server):
    """cispo, dro and gspo off-policy (sampling log-probs shifted from the current ones so that
    some ratios fall outside cispo's clip range, and gspo's sequence ratio, 0.875 over the
    masked tokens, below its lower threshold: its negative-advantage tokens are clipped, the
    others keep their gradient): loss:sum and the adapter's gradients equal the Tinker docs'
    formulas written here, on the log-probs the service returns and (gradients) through the
    same forward with autograd."""
    from engine.tinker.compute import forward_rows
    from engine.tinker.wire import Datum

    service = server["service"]
    tc = _client(server).create_lora_training_client(base_model="llama", rank=2, seed=9).result()
    tc.forward_backward(SFT, "cross_entropy").result()   # a non-zero B: gradients reach A too
    tc.optim_step(types.AdamParams(**ADAM)).result()
    tokens, targets = [5, 6, 7, 8, 9], [6, 7, 8, 9, 10]
    now = tc.forward([_datum(tokens, targets)], "cross_entropy").result() \
        .loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    old = now + np.array([0.3, -0.4, 0.0, 0.5, -0.1])   # ratios 0.74, 1.49, 1, 0.61, 1.11
    adv = np.array([1.0, -0.5, 2.0, 0.7, -1.5])
    params = service.lora.parameters(service.models[tc.model_id].adapter)

    def cispo(lp, xp, low=0.7, high=1.3):
        coefficient = xp.clip(xp.exp(lp - old_t(xp)), low, high)
        coefficient = coefficient.detach() if xp is torch else coefficient
        return -(coefficient * lp * adv_t(xp)).sum()

    def dro(lp, xp, beta=0.3):
        return -(lp * adv_t(xp) - beta / 2 * (lp - old_t(xp)) ** 2).sum()

    mask = np.array([1.0, 1.0, 0.0, 1.0, 0.0])   # log-ratios -0.3, 0.4, -0.5: mean -0.1333

    def gspo(lp, xp, low=0.9, high=1.3):
        sg = lp.detach() if xp is torch else lp
        marked = torch.tensor(mask) != 0 if xp is torch else mask != 0
        ratio = xp.exp((sg - old_t(xp))[marked].mean() + lp - sg)
        return -xp.minimum(ratio * adv_t(xp), xp.clip(ratio, low, high) * adv_t(xp)).sum()

    def old_t(xp):
        return torch.tensor(old, dtype=torch.float32) if xp is torch else old

    def adv_t(xp):
        return torch.tensor(adv, dtype=torch.float32) if xp is torch else adv
    for name, formula, config in (
            ("cispo", cispo, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
            # no loss_fn_config: Tinker's one-sided default (0, 4): no ratio here is clipped
            ("cispo", lambda lp, xp: cispo(lp, xp, 0.0, 4.0), None),
            ("dro", dro, {"beta": 0.3}),
            ("gspo", gspo, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3})):
        extra = {"sequence_ratio_mask": mask.tolist()} if name == "gspo" else {}
        out = tc.forward_backward([_datum(tokens, targets, logprobs=old.tolist(),
                                          advantages=adv.tolist(), **extra)],
                                  name, config).result()
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
        np.testing.assert_allclose(lp, now, rtol=1e-6)
        assert out.metrics["loss:sum"] == pytest.approx(float(formula(lp, np)), rel=1e-5), name
        served = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad():
            mine = forward_rows(service.lora, [(service.models[tc.model_id].adapter, Datum(
                tokens, {"target_tokens": torch.tensor(targets)}))])[0]
            formula(mine, torch).backward()
        for a, p in zip(served, params):
            torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
            p.grad = None


def test_owners_cannot_reach_each_others_models(server):
    tc = _client(server, KEY_A).create_lora_training_client(base_model="llama", rank=2).result()
    path = tc.save_state("mine").result().path
    headers_b = {"X-API-Key": KEY_B}
    r = httpx.post(f"{server['url']}/api/v1/get_info", json={"model_id": tc.model_id},
                   headers=headers_b)
    assert r.status_code == 404 and "model_id" in r.json()["detail"]
    r = httpx.post(f"{server['url']}/api/v1/optim_step", headers=headers_b,
                   json={"model_id": tc.model_id, "adam_params": {"learning_rate": 1.0}})
    assert r.status_code == 404
    with pytest.raises(Exception, match="no such checkpoint"):
        _client(server, KEY_B).create_training_client_from_state(path).result()
    assert httpx.post(f"{server['url']}/api/v1/get_info", json={"model_id": tc.model_id},
                      headers={"X-API-Key": "tml-unknown"}).status_code == 401


def test_bad_input_is_4xx_naming_the_field(server):
    url, h = server["url"], {"X-API-Key": KEY_A}
    tc = _client(server).create_lora_training_client(base_model="llama", rank=2).result()
    with pytest.raises(Exception, match="loss_fn 'stable_reinforce' is not served"):
        tc.forward_backward(SFT, "stable_reinforce").result()
    rl = [_datum([5, 6], [6, 7], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])]
    gspo_config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    with pytest.raises(Exception, match="loss_fn_inputs lacks sequence_ratio_mask"):
        tc.forward_backward(rl, "gspo", gspo_config).result()
    with pytest.raises(Exception, match=r"data\[0\].loss_fn_inputs.sequence_ratio_mask marks no"):
        tc.forward_backward([_datum([5, 6], [6, 7], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0],
                                    sequence_ratio_mask=[0.0, 0.0])], "gspo", gspo_config).result()
    with pytest.raises(Exception, match="loss_fn_config.beta is required by loss_fn 'dro'"):
        tc.forward_backward(rl, "dro").result()
    with pytest.raises(Exception, match="clip_low_threshold 2.0 must be <= clip_high"):
        tc.forward_backward(rl, "cispo", {"clip_low_threshold": 2.0,
                                          "clip_high_threshold": 1.0}).result()
    with pytest.raises(Exception, match=r"weights: 2 values for 5 input tokens"):
        tc.forward_backward([_datum([5, 6, 7, 8, 9], [6, 7, 8, 9, 10], weights=[1, 1])],
                            "cross_entropy").result()
    with pytest.raises(Exception, match="loss_fn_inputs lacks advantages"):
        tc.forward_backward([_datum([5, 6], [6, 7], logprobs=[0.0, 0.0])], "ppo").result()
    with pytest.raises(Exception, match=r"target_tokens: token ids must be in"):
        tc.forward_backward([_datum([5, 6], [6, 10 ** 6])], "cross_entropy").result()
    cases = [("create_model", {"session_id": "nope", "model_seq_id": 0, "base_model": "llama",
                               "lora_config": {"rank": 2}}, 404, "session_id"),
             ("get_info", {"model_id": "nope:train:0"}, 404, "model_id"),
             ("optim_step", {"model_id": tc.model_id, "adam_params": {"beta1": "x"}}, 400,
              "beta1"),
             ("optim_step", {"model_id": tc.model_id, "adam_params": {"beta2": 1.5}}, 400,
              "beta2"),
             ("get_info", {"modelid": "x"}, 400, "model_id"),
             ("retrieve_future", {"request_id": "nope"}, 404, "request_id")]
    for route, body, status, field in cases:
        r = httpx.post(f"{url}/api/v1/{route}", json=body, headers=h)
        assert r.status_code == status and field in r.json()["detail"], (route, r.text)
    r = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff" * 100, headers={
        **h, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/get_info", content=b"{" * (2 ** 20 + 1), headers=h)
    assert r.status_code == 413 and "max-body-mb" in r.json()["detail"]
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="max_tokens"):
        sampler.sample(types.ModelInput.from_ints([5]), 1,
                       types.SamplingParams(max_tokens=10 ** 6)).result()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_refusals_log_nothing_and_the_server_keeps_answering(server):
    """Regression: every 4xx used to be logged by uvicorn as "Exception in ASGI application"
    with a ~4 KB traceback (a handler for Exception runs in Starlette's ServerErrorMiddleware,
    which re-raises); the command whose stderr was an unread pipe hung once 64 KiB of them
    had filled it. 200 refusals of every kind now log nothing, and the server answers."""
    url, h = server["url"], {"X-API-Key": KEY_A}
    records = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    try:
        with httpx.Client(timeout=30) as http:
            for i in range(50):
                assert http.post(f"{url}/api/v1/get_info", json={"model_id": f"x{i}"},
                                 headers=h).status_code == 404
                assert http.post(f"{url}/api/v1/get_info", json={}, headers=h) \
                    .status_code == 400
                assert http.post(f"{url}/api/v1/get_info", json={"model_id": "x"},
                                 headers={"X-API-Key": "tml-nobody"}).status_code == 401
                assert http.post(f"{url}/api/v1/forward_backward", content=b"\xff", headers={
                    **h, "Content-Type": "application/x-protobuf"}).status_code == 400
            assert http.get(f"{url}/api/v1/healthz").status_code == 200
    finally:
        logger.removeHandler(records)
    assert [r.getMessage() for r in records.records] == []


def test_a_failing_request_fails_only_its_own_future(server):
    """Two forward_backward items batched together, one of which fails while running (its
    target_tokens longer than its tokens, which the routes would refuse; submitted directly):
    the failing one's future carries the error, the other's is the same result as alone, and
    the worker goes on serving."""
    from engine.tinker.service import Service
    from engine.tinker.wire import Datum
    from tinker.proto import tinker_public_pb2

    service: Service = server["service"]
    tc = _client(server).create_lora_training_client(base_model="llama", rank=2).result()
    adapter = service.models[tc.model_id].adapter
    good = Datum([5, 6, 7], {"target_tokens": torch.tensor([6, 7, 8])})
    bad = Datum([5, 6], {"target_tokens": torch.tensor([6, 7, 8])})

    def item(d):
        return dict(adapter=adapter, loss_fn="cross_entropy", config={}, data=[d],
                    forward_only=True)
    ids = [service.submit("forward_backward", item(d)) for d in (good, bad)]
    futures = [service.future(i) for i in ids]
    assert all(f.done.wait(60) for f in futures)
    assert futures[1].error is not None and futures[0].error is None
    alone = service.future(service.submit("forward_backward", item(good)))
    assert alone.done.wait(60) and alone.error is None
    a, b = (tinker_public_pb2.ForwardBackwardOutput() for _ in range(2))
    a.ParseFromString(futures[0].result)
    b.ParseFromString(alone.result)
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    assert tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_restarted_server_serves_the_saved_state(server):
    """A second server of the command on the same --state-dir (a fresh Service: the base model
    loaded again, no registry, no adapters; the state directory is all it shares) serves a
    state the first one saved: a client resumed from it with the optimizer takes the same next
    step as the saving client (equal losses after it)."""
    tc = _client(server).create_lora_training_client(base_model="llama", rank=2, seed=5) \
        .result()
    for _ in range(2):
        tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
    path = tc.save_state("restart").result().path
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    expected = tc.forward(SFT, "cross_entropy").result().metrics["loss:sum"]
    second = _serve(server["argv"])
    try:
        assert second["service"] is not server["service"] and not second["service"].models
        resumed = tinker.ServiceClient(base_url=second["url"], api_key=KEY_A) \
            .create_training_client_from_state_with_optimizer(path).result()
        resumed.forward_backward(SFT, "cross_entropy").result()
        resumed.optim_step(types.AdamParams(**ADAM)).result()
        assert resumed.forward(SFT, "cross_entropy").result().metrics["loss:sum"] == expected
    finally:
        second["stop"]()


def _plain_sampling_loop(model, prompt, seeds, max_tokens, temperature, top_k, stop_ids):
    """Sampling written from the formulas, on a transformers (+ peft) model: every row
    recomputed in full each step; the draw is the engine's documented one (row b's uniform
    u(seed_b, step), engine.generation.sampling.uniforms; the first index whose float64
    cumulative probability after top_k exceeds u times the total); log-probs
    log_softmax(logits / T) of the drawn token; a row ends after a stop id."""
    from engine.generation.sampling import uniforms

    out = []
    for seed in seeds:
        tokens, lps = [], []
        u = uniforms(torch.tensor([seed]), 0, max_tokens)[0]
        for step in range(max_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            probs = logp.exp()
            probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
            cdf = probs.double().cumsum(-1)
            tok = int(torch.searchsorted(cdf, u[step] * cdf[-1], right=True))
            tokens.append(tok)
            lps.append(float(logp[tok]))
            if tok in stop_ids:
                break
        out.append((tokens, lps, "stop" if tokens[-1] in stop_ids else "length"))
    return out


def test_sampling_runs_on_the_engine_and_equals_a_plain_loop(server):
    """A sampler's `sample` is one generate call of the engine's hf generation backend
    (engine.tinker.sampler; its call count moves) with the adapter on every row. Against an
    independent loop on transformers + peft with the same adapter (every row recomputed in
    full, the documented draw): the same tokens and stop reasons at temperature 0.8 with top_k
    5 and stop ids (rows end at different steps), log-probs rel 5e-5 (or 2e-6 absolute, near
    zero; the cached and the recomputed sums round apart), and the prompt's log-probs. Negative control: the same loop on the base model (peft's adapter disabled)
    samples other tokens, so the comparison sees the adapter."""
    from engine.generation.base import SamplingParams
    from engine.generation.sampling import row_seeds
    from engine.tinker.lora import LoraSpec, initial_tensors

    sampler = server["service"].backend.sampler
    spec = LoraSpec(rank=4, seed=7)
    generator = torch.Generator().manual_seed(11)   # an adapter that moves the samples
    tensors = {k: torch.randn(v.shape, generator=generator) * 0.3
               for k, v in initial_tensors(spec, sampler.lora.shapes).items()}
    sampler.load("probe", spec, tensors)
    prompt, stop_ids = [5, 6, 7, 8], set(range(20, 40))
    params = dict(max_tokens=10, temperature=0.8, top_k=5, top_p=1.0, seed=4,
                  stop_ids=stop_ids, stop_strings=[])
    calls = sampler.engine.num_generate_calls
    try:
        (seqs, prompt_lps), = sampler.sample([dict(
            adapter="probe", prompt=prompt, num_samples=8, params=params,
            want_prompt_logprobs=True)])
    finally:
        sampler.lora.remove("probe")
    assert sampler.engine.num_generate_calls == calls + 1
    targets = sorted({k.rsplit(".", 2)[-2] for k in tensors})
    model, _ = peft_with_adapter(server["model"], tensors, targets)
    seeds = row_seeds(SamplingParams(max_new_tokens=1, seed=4), 8)
    reference = _plain_sampling_loop(model, prompt, seeds, 10, 0.8, 5, stop_ids)
    assert [s[0] for s in seqs] == [r[0] for r in reference]
    assert [s[2] for s in seqs] == [r[2] for r in reference]
    assert {s[2] for s in seqs} == {"stop", "length"}   # rows ended at different steps
    for s, r in zip(seqs, reference):   # rounding: 1.4e-5 relative seen at other thread counts
        np.testing.assert_allclose(s[1], r[1], rtol=5e-5, atol=2e-6)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])
    assert np.isnan(prompt_lps[0])
    np.testing.assert_allclose(prompt_lps[1:], expected[:, 0].numpy(), rtol=1e-5, atol=2e-6)
    with model.disable_adapter():
        base = _plain_sampling_loop(model, prompt, seeds, 10, 0.8, 5, stop_ids)
    assert [s[0] for s in base] != [r[0] for r in reference]


def test_sample_requests_in_flight_together_run_as_one_generate_call_each_as_alone(server):
    """Four sample requests of one sampling session (other prompts, num_samples, max_tokens,
    seeds; one with prompt log-probs) sent together run as one generate call of all their
    rows (the service's sample_batches), and each request's replies equal those it gets sent
    alone: the same tokens and stop reasons, log-probs within rounding (the rows' decode
    attention spans the call's longest prompt). Control: the same merged rows seeded by their
    position in the call (the classic bug: one seed for the call) draw other tokens."""
    from engine.generation.base import SamplingParams

    service = server["service"]
    tc = _client(server).create_lora_training_client(base_model="llama", rank=4).result()
    tc.forward_backward(SFT, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    asks = [([5, 6, 7], 2, 6, 1), ([8, 9, 10, 11, 12], 3, 4, 2), ([13, 14], 1, 8, 3),
            ([15, 16, 17, 18], 2, 5, 4)]

    def send(k):
        prompt, n, max_tokens, seed = asks[k]
        return sampler.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(
            max_tokens=max_tokens, seed=seed, stop=[]), include_prompt_logprobs=k == 1)
    alone = [send(k).result() for k in range(len(asks))]
    calls = len(service.sample_batches)
    wait, service.batch_wait_s = service.batch_wait_s, 1.0   # all four queued behind the first
    try:
        together = [f.result() for f in [send(k) for k in range(len(asks))]]
    finally:
        service.batch_wait_s = wait
    assert list(service.sample_batches)[calls:] == [8]   # 2 + 3 + 1 + 2 rows, one generate call
    for a, t in zip(alone, together):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in t.sequences]
        assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in t.sequences]
        for sa, st in zip(a.sequences, t.sequences):
            np.testing.assert_allclose(st.logprobs, sa.logprobs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(together[1].prompt_logprobs[1:], alone[1].prompt_logprobs[1:],
                               rtol=1e-5, atol=1e-6)
    assert together[0].prompt_logprobs is None
    # control: one seed for the whole call, rows seeded by their position in it
    engine = service.sample_engine
    adapter = list(service.samplers.by_id.values())[-1].adapter   # the most recently used
    prompts = [p for p, n, _, _ in asks for _ in range(n)]
    with engine.lora.every_row(adapter):
        wrong = engine.engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
    merged = [s.tokens for t in together for s in t.sequences]
    assert sum(w.response_ids[:len(m)] != m for w, m in zip(wrong, merged)) >= 4


def test_several_sessions_sample_requests_share_one_generate_call(server, monkeypatch):
    """Sample requests of two trained models' sessions and the base model's, sent together,
    run as one generate call with each row on its own session's adapter (MultiLora.per_row;
    the prefill one batch forward: HFRolloutEngine.rows_differ), and each request's replies
    equal those it gets alone: the same tokens, log-probs within rounding (the batch
    prefill's padding against the shared prefill alone). Control: every row on the first
    request's adapter (the per-row plan dropped) changes the other sessions' replies."""
    service = server["service"]
    sc = _client(server)
    sessions = []
    for seed in (3, 4):
        tc = sc.create_lora_training_client(base_model="llama", rank=4, seed=seed).result()
        tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
        sessions.append(tc.save_weights_and_get_sampling_client().result())
    sessions.append(sc.create_sampling_client(base_model="llama"))
    asks = [(sessions[0], [5, 6, 7], 2, 1), (sessions[1], [8, 9, 10, 11], 2, 2),
            (sessions[2], [12, 13], 1, 3), (sessions[1], [14, 15, 16], 1, 4)]

    def send(k):
        client, prompt, n, seed = asks[k]
        return client.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(
            max_tokens=6, seed=seed, stop=[]), include_prompt_logprobs=k == 1)

    def together():
        calls = len(service.sample_batches)
        wait, service.batch_wait_s = service.batch_wait_s, 1.0
        try:
            out = [f.result() for f in [send(k) for k in range(len(asks))]]
        finally:
            service.batch_wait_s = wait
        assert list(service.sample_batches)[calls:] == [6]   # 2 + 2 + 1 + 1 rows, one call
        return out
    alone = [send(k).result() for k in range(len(asks))]
    for a, t in zip(alone, together()):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in t.sequences]
        for sa, st in zip(a.sequences, t.sequences):
            np.testing.assert_allclose(st.logprobs, sa.logprobs, rtol=1e-5, atol=1e-6)
    sampler = service.sample_engine
    monkeypatch.setattr(sampler, "rows_of", lambda names: sampler.lora.every_row(names[0]))
    wrong = together()
    assert [s.tokens for s in wrong[0].sequences] == [s.tokens for s in alone[0].sequences]
    assert sum([s.tokens for s in w.sequences] != [s.tokens for s in a.sequences]
               for w, a in zip(wrong[1:], alone[1:])) >= 2


def test_a_stop_string_cuts_the_reply_where_it_first_appears():
    """engine.tinker.sampler.cut_at_stop_string: after the first token whose text so far
    contains a stop string (reason "stop", log-probs cut with it); a reply without one is
    unchanged, its reason kept."""
    from engine.tinker.sampler import cut_at_stop_string

    def decode(tokens):
        return "".join(chr(ord("a") + t) for t in tokens)
    tokens, lps = [0, 1, 2, 3, 1, 2], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert cut_at_stop_string(tokens, lps, "length", ["bc"], decode) == \
        ([0, 1, 2], [-1.0, -2.0, -3.0], "stop")
    assert cut_at_stop_string(tokens, lps, "length", ["zz", "dbc"], decode) == \
        (tokens, lps, "stop")
    assert cut_at_stop_string(tokens, lps, "length", ["zz"], decode) == \
        (tokens, lps, "length")
    assert cut_at_stop_string(tokens, lps, "stop", [], decode) == (tokens, lps, "stop")


def test_a_mixture_of_experts_model_refuses_train_mlp_by_name(tmp_path):
    """transformers' experts are fused 3D parameters, not nn.Linear layers, so no adapter of
    the hf backend reaches them: on a Qwen3-MoE model create_model with train_mlp (the SDK's
    default) is a 400 naming lora_config.train_mlp, where it would otherwise train attention
    alone unannounced; with train_mlp=False the model trains. Control: the dense model's
    MultiLora wraps gate/up/down_proj and serves train_mlp."""
    from engine.tinker.lora import MultiLora
    from tools.tiny_models import build_tiny_model

    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32)
    served = _serve(["--model", moe, "--api-key", KEY_A, "--state-dir", str(tmp_path / "s")])
    try:
        sc = tinker.ServiceClient(base_url=served["url"], api_key=KEY_A)
        with pytest.raises(Exception, match="lora_config.train_mlp: .*mixture-of-experts"):
            sc.create_lora_training_client(base_model="moe", rank=2).result()
        tc = sc.create_lora_training_client(base_model="moe", rank=2, train_mlp=False).result()
        out = tc.forward_backward(SFT, "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        wrapped = {p.rsplit(".", 1)[-1] for p in served["service"].lora.linears}
        assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}
    finally:
        served["stop"]()
    dense = MultiLora.from_folder(build_eos_model(str(tmp_path / "dense")))
    assert dense.unadapted_mlp is None and "model.layers.0.mlp.gate_proj" in dense.linears


def test_the_sampler_holds_at_most_max_samplers_adapters(tmp_path):
    """--max-samplers 2: a third sampling session releases the least recently used one's
    adapter from the sampler (engine.tinker.sampling_sessions). A released snapshot answers
    an error naming --max-samplers; a released session made from a saved path loads its file
    again and samples exactly as before (tokens and log-probs equal). The sampler never holds
    more than 2 sampling adapters although 4 sessions were made (without the release it
    would hold 4)."""
    served = _serve(["--model", build_eos_model(str(tmp_path / "llama")), "--api-key", KEY_A,
                     "--state-dir", str(tmp_path / "s"), "--max-samplers", "2"])
    service = served["service"]

    def held() -> int:   # sampling adapters on the sampler's model (training ones are a...)
        return sum(name.startswith("s") for name in service.lora.specs)

    def greedy(client) -> tuple[list, list]:
        seq = client.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(
            max_tokens=5, temperature=0.0)).result().sequences[0]
        return seq.tokens, seq.logprobs

    def step():
        tc.forward_backward(SFT, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    try:
        sc = tinker.ServiceClient(base_url=served["url"], api_key=KEY_A)
        tc = sc.create_lora_training_client(base_model="llama", rank=4).result()
        step()
        first = tc.save_weights_and_get_sampling_client().result()
        greedy(first)
        path = tc.save_weights_for_sampler("kept").result().path
        from_path = sc.create_sampling_client(model_path=path)
        before = greedy(from_path)
        step()
        second = tc.save_weights_and_get_sampling_client().result()   # releases `first`
        greedy(second)
        assert held() == 2
        with pytest.raises(Exception, match="released.*--max-samplers"):
            greedy(first)
        step()
        third = tc.save_weights_and_get_sampling_client().result()   # releases `from_path`
        sessions = list(service.samplers.by_id.values())   # in least recently used order
        assert held() == 2 and [s.path is not None for s in sessions] == [False, True, False,
                                                                          False]
        assert [s.released for s in sessions] == [True, True, False, False]
        assert greedy(from_path) == before   # loaded again from its file
        assert held() == 2 and sessions[2].released and not sessions[1].released
        assert greedy(third)[0]
    finally:
        served["stop"]()


def test_the_console_command_refuses_bad_flags_by_name(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.cli", "tinker", "--model", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no config.json" in r.stderr and "--model" in r.stderr


def test_the_megatron_layout_overrides_are_checked_before_any_process_starts():
    """engine.tinker.__main__.layout_of: parallel.tp / parallel.pp / parallel.cp /
    parallel.ep / sequence_parallel to a ParallelLayout, checked by parallel.layout against
    the world and the model's layers, heads and experts; vpp other than 1 and unknown keys
    refused by name."""
    from engine.tinker.__main__ import layout_of
    from parallel.layout import ParallelLayout

    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    assert layout_of([], 2, heads) == ParallelLayout(2)
    assert layout_of(["parallel.tp=2"], 2, heads) == \
        ParallelLayout(2, tp=2, sequence_parallel=True)
    assert layout_of(["parallel.tp=2", "parallel.cp=2"], 8, heads) == \
        ParallelLayout(8, tp=2, cp=2, sequence_parallel=True)
    assert layout_of(["parallel.cp=2", "parallel.sequence_parallel=false"], 2, heads) == \
        ParallelLayout(2, cp=2)
    assert layout_of(["parallel.pp=2", "parallel.tp=2"], 8, heads) == \
        ParallelLayout(8, tp=2, pp=2, sequence_parallel=True)
    moe = dict(heads, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    assert layout_of(["parallel.ep=2"], 2, moe) == ParallelLayout(2, ep=2)
    for overrides, world, needle in [
            (["parallel.ep=2"], 2, "parallel.ep=2 needs a mixture-of-experts model"),
            (["parallel.vpp=2"], 2, "parallel.vpp=2: the tinker service's Megatron backend "
                                    "runs tensor, pipeline, context, expert and data "
                                    "parallelism only"),
            (["parallel.pp=4"], 4, "num_hidden_layers=2 is not divisible by parallel.pp"),
            (["parallel.cp=3"], 4, "world size 4 is not divisible by parallel.tp x "
                                   "parallel.pp x parallel.cp"),
            (["parallel.cp=8"], 8, "num_attention_heads=4 is not divisible by parallel.tp x "
                                   "parallel.cp"),
            (["parallel.cp=0"], 2, "parallel.cp=0 must be a positive integer"),
            (["parallel.sequence_parallel=true"], 2, "sequence_parallel=true needs "
                                                     "parallel.tp > 1"),
            (["model.dtype=bf16"], 1, "model.dtype: not a key of the tinker command")]:
        assert needle in layout_of(overrides, world, heads), (overrides, needle)


def test_a_state_file_of_the_earlier_format_loads_with_its_adamw_moments():
    """State files written before the AdamW state became layout-independent held torch's
    optimizer.state_dict() (parameters in the adapter's key order); engine.tinker.legacy_state
    .legacy_optimizer reads them as today's {"adam": step, exp_avg, exp_avg_sq by key}, the
    moments landing on their own keys (negative control: keys in another order do not)."""
    from engine.tinker.legacy_state import legacy_optimizer

    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4, 2))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    keys = ["model.layers.0.mlp.down_proj.A", "model.layers.0.mlp.down_proj.B"]
    old = {"adapter": {k: p.detach().clone() for k, p in zip(keys, params)},
           "optimizer": opt.state_dict(), "steps": 1}
    state = legacy_optimizer(dict(old))
    assert "optimizer" not in state and state["adam"]["step"] == 1
    for k, p in zip(keys, params):
        assert torch.equal(state["adam"]["exp_avg"][k], opt.state[p]["exp_avg"])
        assert torch.equal(state["adam"]["exp_avg_sq"][k], opt.state[p]["exp_avg_sq"])
    swapped = legacy_optimizer({**old, "adapter": dict(reversed(list(old["adapter"].items())))})
    assert swapped["adam"]["exp_avg"][keys[0]].shape != opt.state[params[0]]["exp_avg"].shape
    assert legacy_optimizer({"adapter": {}, "adam": None})["adam"] is None


def test_a_follower_rank_says_when_a_call_fails_and_goes_on(monkeypatch, capsys):
    """engine.tinker.lockstep.follow: a call that raises on a follower is printed on its stderr
    with the rank and the call (not swallowed), and the follower serves the next call."""
    from engine.tinker import lockstep
    messages = [("optim_step", (), {}), ("export", ("m",), {}), (lockstep.STOP, (), {})]
    ran = []

    def broadcast(box, src, group):
        box[0] = messages.pop(0)

    class Local:
        def optim_step(self):
            raise RuntimeError("out of memory on this rank")

        def export(self, model):
            ran.append(model)

    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(lockstep.dist, "get_rank", lambda: 3)
    lockstep.follow(Local(), group=None)
    err = capsys.readouterr().err
    assert "[tinker rank 3] optim_step failed: RuntimeError: out of memory on this rank" in err
    assert ran == ["m"] and not messages
