"""How our preference tokenisation differs from TRL's DPOTrainer, measured on a tiny model.

    python -m tools.dpo_trl_tokens [--steps 30] [--json OUT]

Builds a tiny random Qwen3 model with the character-level Qwen3 chat tokenizer
(tools/char_tokenizer.py; nothing downloaded), lets trl.DPOTrainer (the installed TRL) tokenise
a small conversational preference set and renders the same rows with
engine.data.preference_render. Prints where the token sequences differ. The reference is the
tiny model after --sft-steps of next-token training on the full rendered chats (so it knows
the template, as a real chat model does: the newline after <|im_end|> becomes near certain).
Then two policies train from the reference for --steps Adam steps with the same sigmoid DPO
loss (beta 0.1, TRL's formula: summed completion log-probs), one on TRL's tokens and one on
ours, and both are evaluated under both tokenisations: the sequence log-probs, the DPO loss and
the reward margin each tokenisation gives the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F

BETA = 0.1


def _rows() -> list[dict]:
    rows = []
    for a in range(1, 9):
        for b in (2, 5):
            prompt = [{"role": "user", "content": f"What is {a}+{b}?"}]
            if b == 5:
                prompt = [{"role": "system", "content": "Answer briefly."}] + prompt
            rows.append({"prompt": prompt,
                         "chosen": [{"role": "assistant", "content": f"{a}+{b}={a + b}."}],
                         "rejected": [{"role": "assistant", "content": f"It is {a + b + 1}."}]})
    return rows


def _trl_tokens(model_dir: str, tok, rows: list[dict]) -> list[dict]:
    """prompt_ids / chosen_ids / rejected_ids as DPOTrainer's own dataset preparation makes
    them."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True,
                     max_length=None, beta=BETA)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                         args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tok)
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    return [{k: list(r[k]) for k in keys} for r in trainer.train_dataset]


def _our_tokens(tok, rows: list[dict]) -> list[dict]:
    """Our rendering in TRL's collator form: the completion is the side's trained span (the
    untrained newline after the end-of-turn token is left out)."""
    from engine.data.preference_render import render_preference_row

    out = []
    for i, row in enumerate(rows):
        pair = render_preference_row(row, tok, f"row {i}")
        p = pair.prompt_length
        ends = [int(s.trained.nonzero()[0][-1]) + 1 for s in (pair.chosen, pair.rejected)]
        out.append({"prompt_ids": pair.chosen.ids[:p], "chosen_ids": pair.chosen.ids[p:ends[0]],
                    "rejected_ids": pair.rejected.ids[p:ends[1]]})
    return out


def _logps(model, batch: dict) -> torch.Tensor:
    """Summed completion log-probs per sequence ([chosen..., rejected...]), TRL's formula."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    tok = torch.gather(logp, 2, batch["input_ids"][:, 1:, None]).squeeze(2)
    return (tok * batch["completion_mask"][:, 1:]).sum(1)


def _loss(policy, ref_logps: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logps = _logps(policy, batch)
    pc, pr = logps.chunk(2)
    rc, rr = ref_logps.chunk(2)
    return -F.logsigmoid(BETA * ((pc - rc) - (pr - rr))).mean(), logps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from tools.char_tokenizer import build_char_tokenizer
    from tools.tiny_models import build_tiny_model

    torch.manual_seed(0)
    model_dir = tempfile.mkdtemp()
    tok = build_char_tokenizer(model_dir, "qwen3")
    build_tiny_model(model_dir, "qwen3", vocab_size=len(tok), tokenizer=False,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = _rows()
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
    forms = {"trl": _trl_tokens(model_dir, tok, rows), "ours": _our_tokens(tok, rows)}
    report = {"rows": len(rows), "differences": _differences(tok, forms)}
    batches = {k: collate(v) for k, v in forms.items()}
    ref_dir = _sft_warmup(model_dir, batches["trl"], args.sft_steps)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    with torch.no_grad():
        ref_logps = {k: _logps(ref, b) for k, b in batches.items()}
    report["ref_logp_trl_minus_ours"] = _side_means(ref_logps["trl"] - ref_logps["ours"])
    for trained_on in ("trl", "ours"):
        policy = AutoModelForCausalLM.from_pretrained(ref_dir).train()
        opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
        for _ in range(args.steps):
            loss, _ = _loss(policy, ref_logps[trained_on], batches[trained_on])
            opt.zero_grad()
            loss.backward()
            opt.step()
        policy.eval()
        with torch.no_grad():
            evals = {k: _loss(policy, ref_logps[k], b) for k, b in batches.items()}
        report[f"trained_on_{trained_on}"] = {
            "loss_trl": float(evals["trl"][0]), "loss_ours": float(evals["ours"][0]),
            "margin_trl": _margin(evals["trl"][1], ref_logps["trl"]),
            "margin_ours": _margin(evals["ours"][1], ref_logps["ours"]),
            "logp_trl_minus_ours": _side_means(evals["trl"][1] - evals["ours"][1])}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _sft_warmup(model_dir: str, batch: dict, steps: int) -> str:
    """The model after `steps` of next-token training on every token of `batch`'s sequences
    (prompt, completion, the template's newlines), saved to a new folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(steps):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tempfile.mkdtemp()
    model.save_pretrained(out)
    return out


def _margin(logps: torch.Tensor, ref_logps: torch.Tensor) -> float:
    """Mean reward margin beta * ((chosen - ref) - (rejected - ref))."""
    pc, pr = logps.chunk(2)
    rc, rr = ref_logps.chunk(2)
    return float((BETA * ((pc - rc) - (pr - rr))).mean())


def _side_means(diff: torch.Tensor) -> dict:
    c, r = diff.chunk(2)
    return {"chosen_mean": float(c.mean()), "rejected_mean": float(r.mean()),
            "chosen_max_abs": float(c.abs().max()), "rejected_max_abs": float(r.abs().max())}


def _differences(tok, forms: dict) -> dict:
    """Rows whose prompt / completion tokens differ, and the first row's texts."""
    out = {}
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        differ = [i for i, (a, b) in enumerate(zip(forms["trl"], forms["ours"])) if a[key] != b[key]]
        out[key] = {"rows_differing": len(differ),
                    "trl_first": tok.decode(forms["trl"][0][key]),
                    "ours_first": tok.decode(forms["ours"][0][key])}
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
