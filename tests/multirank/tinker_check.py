"""The Tinker service's operations (engine.tinker.adapters.Adapters, what its worker runs) on the
Megatron backend at a pool layout, and the same script on the transformers backend in the test
process (tests/test_tinker_megatron.py).

`exercise(adapters)`: two LoRA models of different ranks and seeds, their forward_backward
items batched together (cross_entropy, importance_sampling, ppo rows), three optim_steps each
(clipping on), then both adapters' states with AdamW's moments and a greedy sample of each
(a sampler snapshot of each, sampled on the root's engine.tinker.sampler). Returns a record
of plain numbers."""
from __future__ import annotations

import torch

from engine.tinker.adapters import Adapters
from engine.tinker.losses import check_loss
from engine.tinker.lora import LoraSpec, MultiLora
from engine.tinker.sampler import EngineSampler
from engine.tinker.wire import Datum

ADAM = dict(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01,
            grad_clip_norm=5.0)
RL_INPUTS = {"target_tokens", "logprobs", "advantages"}
SPECS = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=2, seed=7, train_unembed=False)}
# a MoE model's (neither backend adapts its experts: train_mlp is refused)
MOE_SPECS = {"a": LoraSpec(rank=4, seed=1, train_mlp=False),
             "b": LoraSpec(rank=2, seed=7, train_mlp=False, train_unembed=False)}


def _datum(tokens: list[int], **inputs) -> Datum:
    targets = tokens[1:] + [tokens[0]]
    return Datum(tokens, {"target_tokens": torch.tensor(targets),
                          **{k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}})


def _items(step: int) -> list[dict]:
    """Step `step`'s forward_backward items: model a's SFT rows and model b's RL rows."""
    g = torch.Generator().manual_seed(step)

    def toks(n):
        return torch.randint(4, 200, (n,), generator=g).tolist()

    def rl(n):
        return _datum(toks(n), logprobs=(-3 - torch.rand(n, generator=g)).tolist(),
                      advantages=(torch.randn(n, generator=g)).tolist())
    sft = [_datum(toks(n), weights=[0.0] * 2 + [1.0] * (n - 2)) for n in (9, 5, 13)]
    return [
        {"adapter": "a", "loss_fn": "cross_entropy", "data": sft, "backward": True,
         "config": check_loss("cross_entropy", {"target_tokens", "weights"}, None)},
        {"adapter": "b", "loss_fn": "importance_sampling", "data": [rl(7), rl(11)],
         "backward": True, "config": check_loss("importance_sampling", RL_INPUTS, None)},
        {"adapter": "b", "loss_fn": "ppo", "data": [rl(6)], "backward": True,
         "config": check_loss("ppo", RL_INPUTS, None)},
        {"adapter": None, "loss_fn": "cross_entropy", "data": [_datum(toks(4))],
         "backward": False, "config": check_loss("cross_entropy", {"target_tokens"}, None)}]


def exercise(adapters: Adapters, control=None, reverse: bool = False, specs: dict = SPECS
             ) -> dict | None:
    """The script (module docstring) on `adapters`; the record on the root, None elsewhere.
    `control(adapters)`: applied once the models exist (negative controls). `reverse`: every
    batch's items and rows in the opposite order (the same sums in another order: the
    rounding envelope of the states; the record's per-row entries come in that order).
    `specs`: the two models' LoraSpecs (SPECS, or MOE_SPECS on a MoE model)."""
    for name, spec in specs.items():
        adapters.create(name, spec)
    if control is not None:
        control(adapters)
    record = {"losses": [], "logprobs": [], "grad_norms": []}
    for step in range(3):
        items = _items(step)
        if reverse:
            items = [dict(item, data=item["data"][::-1]) for item in items[::-1]]
        results = adapters.run_losses(items, True)
        norms = [adapters.optim_step(name, ADAM)["grad_norm:mean"] for name in specs]
        if results is not None:
            record["losses"].append([r["metrics"]["loss:sum"] for r in results])
            record["logprobs"].append([o["logprobs"].tolist() for r in results
                                       for o in r["outputs"]])
            record["grad_norms"].append(norms)
    states = {name: adapters.export(name, True) for name in specs}
    for name, spec in specs.items():   # sampler snapshots: exported on every rank
        adapters.frozen(f"sampler {name}", spec, source=name)
    if not adapters.ranks.root:
        return None
    greedy = dict(max_tokens=6, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=set(),
                  stop_strings=[])
    samples = {name: adapters.sample([dict(
        adapter=f"sampler {name}", prompt=[5, 6, 7, 8], num_samples=2,
        want_prompt_logprobs=True, params=greedy)])[0] for name in specs}
    record["states"] = {name: {"adapter": _numpy(s["adapter"]), "step": s["adam"]["step"],
                               "exp_avg": _numpy(s["adam"]["exp_avg"]),
                               "exp_avg_sq": _numpy(s["adam"]["exp_avg_sq"])}
                        for name, s in states.items()}
    record["samples"] = {name: ([seq[0] for seq in s[0]], [seq[1] for seq in s[0]], s[1])
                         for name, s in samples.items()}
    return record


def _numpy(tensors: dict) -> dict:
    """Tensors as numpy arrays (a pool case's result is pickled to the test process)."""
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def no_tp_reduction(adapters: Adapters) -> None:
    """Negative control: the adapters' TP reductions off (models.lora.adapters `reduce`)."""
    for site in adapters.lora.tenants.sites:
        for adapter in site.adapters.values():
            adapter.reduce = False


def _megatron_adapters(model_dir: str, tp: int, sequence_parallel: bool, cp: int = 1,
                       pp: int = 1, ep: int = 1) -> Adapters:
    """The Megatron backend's Adapters at tp x pp x cp x (world / (tp x pp x cp)) on this
    pool's ranks (the service's operations without its HTTP front)."""
    import torch.distributed as dist

    from engine.tinker.mcore import MegatronLora
    from engine.tinker.mcore_ranks import MegatronRanks
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, cp=cp, ep=ep,
                                        sequence_parallel=sequence_parallel))
    sampler = EngineSampler(MultiLora.from_folder(model_dir), model_dir, str) \
        if dist.get_rank() == 0 else None   # as engine.tinker.megatron_start
    return Adapters(MegatronLora(model_dir, sequence_parallel), MegatronRanks(), sampler)


def megatron(model_dir: str, tp: int, sequence_parallel: bool, control: str | None = None,
             cp: int = 1, pp: int = 1, ep: int = 1, specs: dict = SPECS) -> dict | None:
    """`exercise` on the Megatron backend at tp x pp x cp x (world / (tp x pp x cp)) on this
    pool's ranks (experts over ep); `control`: a negative control's name (tp, dp, cp, pp)."""
    adapters = _megatron_adapters(model_dir, tp, sequence_parallel, cp, pp, ep)
    return exercise(adapters, {"tp": no_tp_reduction, "dp": _skip_dp_sum, "cp": _skip_cp_sum,
                               "pp": _skip_pp_norm_sum, None: None}[control], specs=specs)


def _skip_dp_sum(adapters: Adapters) -> None:
    """Negative control: each replica steps on its own rows' gradients (the DP sum dropped,
    the sequence-parallel TP sum kept)."""
    from engine.tinker.mcore_ranks import _all_reduce

    ranks = adapters.ranks
    ranks.reduce_grads = lambda params: _all_reduce(
        [p.grad for p in params if getattr(p, "sequence_parallel", False)], ranks.tp_group)


def _skip_cp_sum(adapters: Adapters) -> None:
    """Negative control: each CP rank steps on its own tokens' gradients (the CP sum
    dropped, the DP sum kept)."""
    from engine.tinker.mcore_ranks import _all_reduce

    ranks = adapters.ranks
    ranks.reduce_grads = lambda params: _all_reduce([p.grad for p in params], ranks.dp_group)


def _skip_pp_norm_sum(adapters: Adapters) -> None:
    """Negative control: each pipeline stage clips with its own layers' gradient norm (the
    norm's sum over PP taken over this rank alone)."""
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]   # collective
    adapters.ranks.pp_group = alone[dist.get_rank()]


def few_rows(adapters: Adapters, specs: dict = SPECS) -> dict | None:
    """Batches with fewer rows than replicas or without a backward on some: model a's one
    cross_entropy row; a forward-only call; a's row with the base model's forward-only row;
    an optim_step after each call with a backward; first, a call whose first row's loss fails
    (advantages one longer than its tokens): it raises on every rank and changes no
    gradient, and the calls after it run as they would have (on pipeline stages its later
    micro-batches still pass every stage). Returns on the
    root the losses, log-probs and grad norms, whether the failing call raised, and a's
    state."""
    adapters.create("a", specs["a"])
    one = _items(0)[0]
    one = dict(one, data=one["data"][:1])
    base = _items(0)[3]
    bad = dict(_items(0)[1], adapter="a")
    bad = dict(bad, data=[_datum(list(range(5, 12)), logprobs=[-1.0] * 7,
                                 advantages=[1.0] * 8)])
    record = {"losses": [], "logprobs": [], "grad_norms": [], "raised": False}
    try:
        adapters.run_losses([bad, one, dict(one, data=one["data"] * 3)], True)
    except Exception:
        record["raised"] = True
    for items, grad in (([one], True), ([base], False), ([one, base], True)):
        results = adapters.run_losses(items, grad)
        if grad:
            record["grad_norms"].append(adapters.optim_step("a", ADAM)["grad_norm:mean"])
        if results is not None:
            record["losses"].append([r["metrics"]["loss:sum"] for r in results])
            record["logprobs"].append([o["logprobs"].tolist() for r in results
                                       for o in r["outputs"]])
    state = adapters.export("a", True)
    if not adapters.ranks.root:
        return None
    record["states"] = {"a": {"adapter": _numpy(state["adapter"]),
                              "exp_avg": _numpy(state["adam"]["exp_avg"])}}
    return record


def megatron_few_rows(model_dir: str, tp: int, sequence_parallel: bool, cp: int = 1,
                      pp: int = 1, ep: int = 1, specs: dict = SPECS) -> dict | None:
    """`few_rows` on the Megatron backend at this layout (experts over ep), with the
    backend's `unadapted_mlp` (why train_mlp is refused) in the record."""
    adapters = _megatron_adapters(model_dir, tp, sequence_parallel, cp, pp, ep)
    record = few_rows(adapters, specs)
    return None if record is None else dict(record, unadapted_mlp=adapters.lora.unadapted_mlp)


def isolation(model_dir: str, tp: int, sequence_parallel: bool, cp: int = 1, pp: int = 1
              ) -> dict | None:
    """Model "a" trained 2 steps alone, then (a fresh "a") 2 steps with "b"'s rows batched
    into every forward_backward, on the Megatron backend at tp x pp x cp x (the rest); a
    third model "c" never trained. Returns on the root a's largest relative gap (losses,
    log-probs, state) between the two runs, whether they are bitwise equal, and whether c is
    bitwise unchanged."""
    adapters = _megatron_adapters(model_dir, tp, sequence_parallel, cp, pp)
    adapters.create("c", SPECS["a"])
    c_before = adapters.export("c", False)["adapter"]
    runs = []
    for together in (False, True):
        adapters.create("a", SPECS["a"])
        adapters.create("b", SPECS["b"])
        losses, logprobs = [], []
        for step in range(2):
            items = _items(step)[:1] + (_items(step)[1:3] if together else [])
            results = adapters.run_losses(items, True)
            for name in ("a", "b") if together else ("a",):
                adapters.optim_step(name, ADAM)
            if results is not None:
                losses.append(results[0]["metrics"]["loss:sum"])
                logprobs.append(torch.cat([torch.as_tensor(o["logprobs"])
                                           for o in results[0]["outputs"]]))
        state = adapters.export("a", True)["adapter"]   # collective: every rank
        runs.append((torch.tensor(losses), torch.cat(logprobs) if logprobs else None, state))
        adapters.remove("a")
        adapters.remove("b")
    c_after = adapters.export("c", False)["adapter"]
    if not adapters.ranks.root:
        return None
    (l0, p0, s0), (l1, p1, s1) = runs

    def rel(x, y):
        return float((x - y).abs().max() / y.abs().max())
    return {"run_gap": max(rel(l1, l0), rel(p1, p0)),
            "state_gap": max(rel(s1[k], s0[k]) for k in s0),
            "bitwise": bool(torch.equal(l0, l1) and torch.equal(p0, p1)
                            and all(torch.equal(s0[k], s1[k]) for k in s0)),
            "c_untouched": all(torch.equal(c_before[k], c_after[k]) for k in c_before)}
