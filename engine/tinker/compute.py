"""The model computations of the Tinker service, on the shared base model (engine.tinker.lora):
one batched forward (and backward) over rows of several adapters, an AdamW step on one
adapter, sampling and prompt log-probs. Runs on the service's worker thread only.

`forward_rows(lora, rows)`: rows are (adapter or None, Datum); the token sequences are
right-padded to the longest (causal attention: a real token never attends to a later pad, so
padding changes no real position) and run through the model in one call (engine.tinker.lora:
a row's numbers are bit-identical whatever else is in the batch); returns each row's
per-token log-probs log p(target_tokens[t] | tokens[<=t]) [T] in float32, differentiable
where the row's adapter has gradients."""
from __future__ import annotations

import torch

from engine.tinker.losses import LOSSES
from engine.tinker.wire import Datum


def forward_rows(lora, rows: list[tuple[str | None, Datum]]) -> list[torch.Tensor]:
    longest = max(len(d.tokens) for _, d in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, (_, d) in enumerate(rows):
        ids[i, :len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
    lora.assign([name for name, _ in rows], [len(d.tokens) for _, d in rows])
    try:
        logits = lora.model(input_ids=ids, use_cache=False).logits.float()
    finally:
        lora.assign(None)
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, (_, d) in enumerate(rows):
        targets = d.inputs["target_tokens"].long()
        out.append(logp[i, :len(d.tokens)].gather(-1, targets[:, None])[:, 0])
    return out


def run_losses(lora, items: list[dict], grad: bool) -> list[dict]:
    """One forward (and, where an item asks for it, backward) over every datum of every item.
    An item: {"adapter", "loss_fn", "config", "data": [Datum], "backward": bool}. Returns per
    item {"outputs": [{"logprobs", "elementwise_loss"} numpy], "metrics": {"loss:sum"}}.
    Gradients add into the adapters' .grad (accumulating until their optim_step)."""
    rows = [(item["adapter"], d) for item in items for d in item["data"]]
    with torch.enable_grad() if grad else torch.no_grad():
        logprobs = forward_rows(lora, rows)
        total = None
        results, k = [], 0
        for item in items:
            loss_fn = LOSSES[item["loss_fn"]]
            outputs, item_loss = [], None
            for d in item["data"]:
                lp = logprobs[k]
                k += 1
                inputs = {n: t for n, t in d.inputs.items() if n != "target_tokens"}
                loss = loss_fn(lp, inputs, item["config"])
                elementwise = None
                if item["loss_fn"] == "cross_entropy":
                    w = inputs.get("weights")
                    elementwise = -(lp * w) if w is not None else -lp
                outputs.append({"logprobs": lp.detach().numpy().copy(),
                                **({"elementwise_loss": elementwise.detach().numpy().copy()}
                                   if elementwise is not None else {})})
                item_loss = loss if item_loss is None else item_loss + loss
            if item["backward"] and grad:
                total = item_loss if total is None else total + item_loss
            results.append({"outputs": outputs, "metrics": {"loss:sum": float(item_loss.detach())}})
        if total is not None and total.requires_grad:
            total.backward()
    return results


def adam_step(params: list[torch.nn.Parameter], optimizer: torch.optim.AdamW, adam: dict) -> dict:
    """One AdamW step of one adapter with this step's AdamParams; clears its gradients.
    grad_clip_norm > 0 clips the adapter's global gradient norm first. Returns metrics."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                 for p in params]))
    if adam["grad_clip_norm"] > 0:
        torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
    for group in optimizer.param_groups:
        group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]),
                     eps=adam["eps"], weight_decay=adam["weight_decay"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm:mean": float(norm)}


@torch.no_grad()
def prompt_logprobs(lora, adapter: str | None, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[<i]) for i >= 1; NaN at position 0 (the SDK's None)."""
    d = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])}) if len(tokens) > 1 \
        else None
    rest = forward_rows(lora, [(adapter, d)])[0].tolist() if d is not None else []
    return [float("nan")] + rest


@torch.no_grad()
def sample(lora, adapter: str | None, prompt: list[int], num_samples: int, max_tokens: int,
           temperature: float, top_k: int, top_p: float, seed: int, stop_ids: set[int],
           stop_strings: list[str], decode) -> list[tuple[list[int], list[float], str]]:
    """num_samples continuations of `prompt` (one batch, recomputed in full each step: tiny
    models only). A sequence stops after a stop token (kept) or once its text contains a stop
    string, reason "stop"; else after max_tokens, "length". logprobs: of each sampled token
    under the sampled distribution (logits / temperature; temperature 0: greedy, raw
    log-softmax)."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [list(prompt) for _ in range(num_samples)]
    out = [([], [], "length") for _ in range(num_samples)]
    live = list(range(num_samples))
    for _ in range(max_tokens):
        if not live:
            break
        rows = [(adapter, Datum(seqs[i], {})) for i in live]
        longest = max(len(seqs[i]) for i in live)
        ids = torch.zeros(len(live), longest, dtype=torch.long)
        for r, i in enumerate(live):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
        lora.assign([a for a, _ in rows], [len(seqs[i]) for i in live])
        try:
            logits = lora.model(input_ids=ids, use_cache=False).logits.float()
        finally:
            lora.assign(None)
        last = torch.stack([logits[r, len(seqs[i]) - 1] for r, i in enumerate(live)])
        if temperature == 0:
            logp = torch.log_softmax(last, -1)
            picks = logp.argmax(-1)
        else:
            logp = torch.log_softmax(last / temperature, -1)
            probs = logp.exp()
            if top_k > 0:
                kth = probs.topk(min(top_k, probs.shape[-1]), -1).values[:, -1:]
                probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
            if top_p < 1:
                sorted_p, order = probs.sort(-1, descending=True)
                keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
                probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
            picks = torch.multinomial(probs, 1, generator=generator)[:, 0]
        still = []
        for r, i in enumerate(live):
            tok = int(picks[r])
            seqs[i].append(tok)
            out[i][0].append(tok)
            out[i][1].append(float(logp[r, tok]))
            text = decode(out[i][0]) if stop_strings else ""
            if tok in stop_ids or any(s in text for s in stop_strings):
                out[i] = (out[i][0], out[i][1], "stop")
            else:
                still.append(i)
        live = still
    return out
