"""The model computations of the Tinker service on the shared base model: one batched forward
(and backward) over rows of several adapters and an AdamW step on one adapter (sampling:
engine.tinker.sampler). `lora` is either backend's model (engine.tinker.lora.MultiLora:
transformers, one process; engine.tinker.mcore.MegatronLora: Megatron-Core at a TP / DP
layout), `ranks` its replicas (engine.tinker.ranks). Runs on the service's worker thread, and
on every other rank in lockstep with it (engine.tinker.lockstep).

`forward_rows(lora, rows)`: rows are (adapter or None, Datum); the token sequences are
right-padded to the longest (causal attention: a real token never attends to a later pad, so
padding changes no real position) and run through the model in one call (engine.tinker.lora:
on one process a row's numbers are bit-identical whatever else is in the batch); returns each
row's per-token log-probs log p(target_tokens[t] | tokens[<=t]) [T] in float32,
differentiable where the row's adapter has gradients."""
from __future__ import annotations

import torch

from engine.tinker.losses import LOSSES
from engine.tinker.wire import Datum


IDLE_ROW = Datum([0], {"target_tokens": torch.tensor([0])})   # results never read


def right_padded(seqs: list[list[int]]) -> torch.Tensor:
    """int64 [len(seqs), longest]: the token sequences, zeros after each one's end."""
    ids = torch.zeros(len(seqs), max(len(t) for t in seqs), dtype=torch.long)
    for i, tokens in enumerate(seqs):
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids


def forward_rows(lora, rows: list[tuple[str | None, Datum]]) -> list[torch.Tensor]:
    ids = right_padded([d.tokens for _, d in rows])
    logits = lora.logits(ids, [name for name, _ in rows], [len(d.tokens) for _, d in rows])
    if logits is None:   # a pipeline stage before the last (engine.tinker.mcore)
        return []
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, (_, d) in enumerate(rows):
        targets = d.inputs["target_tokens"].long().to(logp.device)
        out.append(logp[i, :len(d.tokens)].gather(-1, targets[:, None])[:, 0])
    return out


def _row_losses(items: list[dict], rows: list[tuple], mine: list[int],
                logprobs: list[torch.Tensor], grad: bool, per_row: dict) -> torch.Tensor | None:
    """The losses of rows `mine` (indices into `rows`, with their log-probs `logprobs`; none
    on a pipeline stage before the last): each row's (outputs, loss) into `per_row`;
    returns the sum of the losses of rows whose item has a backward (None: none)."""
    total = None
    for r, lp in zip(mine, logprobs):
        k, _, d = rows[r]
        item = items[k]
        inputs = {n: t.to(lp.device) for n, t in d.inputs.items() if n != "target_tokens"}
        loss = LOSSES[item["loss_fn"]](lp, inputs, item["config"])
        out = {"logprobs": lp.detach().cpu().numpy().copy()}
        if item["loss_fn"] == "cross_entropy":
            w = inputs.get("weights")
            out["elementwise_loss"] = (-(lp * w) if w is not None else -lp
                                       ).detach().cpu().numpy().copy()
        per_row[r] = (out, float(loss.detach()))
        if item["backward"] and grad:
            total = loss if total is None else total + loss
    return total


def run_losses(lora, items: list[dict], grad: bool, ranks) -> list[dict] | None:
    """One forward (and, where an item asks for it, backward) over every datum of every item.
    An item: {"adapter", "loss_fn", "config", "data": [Datum], "backward": bool}. Returns per
    item {"outputs": [{"logprobs", "elementwise_loss"} numpy], "metrics": {"loss:sum"}} on
    the root (None elsewhere). Gradients add into the adapters' .grad (accumulating until
    their optim_step).

    `ranks` (engine.tinker.ranks) spreads the data over the data-parallel replicas: each
    replica runs its rows (all of them on one process), the losses are sums, so the replicas'
    gradients add up to the whole batch's when optim_step sums them. A row whose loss fails
    on any rank fails the call on every rank before any backward (ranks.agree), so no replica
    keeps a partial gradient. The rows run in `lora.micro_batches` (one, except on pipeline
    stages, where micro-batches keep every stage busy: engine.tinker.mcore); all their
    forwards, then the agreement, then their backwards in reverse order (`lora.backward` per
    micro-batch, on every stage; only the last stage holds log-probs and losses). A model
    whose `every_replica` is true (engine.tinker.mcore under expert parallelism: the
    experts' all-to-alls are collective over replicas) runs a forward on every replica, one
    IDLE_ROW where it has no rows, and a backward on every replica when any replica has one
    to run, of a zero loss where it has none of its own."""
    rows = [(k, item["adapter"], d) for k, item in enumerate(items) for d in item["data"]]
    mine = ranks.split([len(d.tokens) for _, _, d in rows])
    every = lora.every_replica
    # the same on every pipeline stage of a replica (all take part in the backward), and on
    # every replica where they all must (`every`)
    backward = grad and any(items[rows[r][0]]["backward"]
                            for r in (range(len(rows)) if every else mine))
    batch = [(rows[r][1], rows[r][2]) for r in mine]
    if every and not batch:   # a replica without rows still takes its part
        batch = [(None, IDLE_ROW)]
    per_row, totals, error = {}, [], None
    with torch.enable_grad() if grad else torch.no_grad():
        # every micro-batch's forward runs on every stage even after a row's loss failed,
        # so the stages' sends and receives stay paired
        for lo, hi in lora.micro_batches(len(batch)):
            try:
                logprobs = forward_rows(lora, batch[lo:hi])
                total = None if error is not None else _row_losses(
                    items, rows, mine[lo:hi], logprobs, grad, per_row)
                if backward and total is None and logprobs:   # `every`: zero gradients
                    total = torch.stack([lp.sum() for lp in logprobs]).sum() * 0.0
                totals.append(total)
            except Exception as e:
                error = error or e
        ranks.agree(error)
        if backward:
            for total in reversed(totals):   # the stages' backwards in the same order
                lora.backward(total)
    gathered = ranks.gather(per_row)
    if gathered is None:
        return None
    results, r = [], 0
    for item in items:
        outputs, loss_sum = [], 0.0
        for _ in item["data"]:
            out, loss = gathered[r]
            outputs.append(out)
            loss_sum += loss
            r += 1
        results.append({"outputs": outputs, "metrics": {"loss:sum": loss_sum}})
    return results


def adam_step(params: list[torch.nn.Parameter], optimizer: torch.optim.AdamW, adam: dict,
              ranks) -> dict:
    """One AdamW step of one adapter with this step's AdamParams; clears its gradients.
    The gradients are first summed over the replicas (`ranks.reduce_grads`); grad_clip_norm
    > 0 scales them by min(1, clip / (norm + 1e-6)) with the adapter's global norm, as
    torch.nn.utils.clip_grad_norm_ does. Returns metrics: grad_norm:mean, before clipping."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    ranks.reduce_grads(params)
    norm = ranks.grad_norm(params)
    if adam["grad_clip_norm"] > 0:
        coef = torch.clamp(adam["grad_clip_norm"] / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.device))
    for group in optimizer.param_groups:
        group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]),
                     eps=adam["eps"], weight_decay=adam["weight_decay"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm:mean": float(norm)}
