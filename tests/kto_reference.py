"""The independent references of KTO's exactness tests (tests/test_dpo.py, the KTO section):
a plain transformers + torch AdamW loop written from the formulas, and TRL 1.16's KTOTrainer
fed the harness's token ids (tests/multirank/kto_check.py)."""
from __future__ import annotations

import torch

from tests.multirank import dpo_check as harness
from tests.multirank import kto_check

TRL_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected", "logits/chosen", "logits/rejected", "entropy")


def _parts(example) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a harness example."""
    ids = example.sample.tokens + example.sample.labels[-1:]
    return ids[:example.prompt_length], ids[example.prompt_length:]


def _completion_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt) - 1:].sum()


def plain_loop(policy_dir: str, reference_dir: str, flags: dict) -> dict:
    """{loss, grad_norm, kl: [per step]}: the KL reference point kl = max(0, mean over the
    batch of log pi(y_{i-1} | x_i) - log ref(y_{i-1} | x_i)) without gradient; per example
    z = log pi(y|x) - log ref(y|x) and the loss w_d (1 - sigmoid(beta (z - kl))) if desirable,
    w_u (1 - sigmoid(beta (kl - z))) if not, averaged over the batch; AdamW, clip 1."""
    from transformers import AutoModelForCausalLM

    cfg = kto_check.run_cfg(flags).kto
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=harness.LR, betas=(0.9, 0.95),
                            eps=harness.ADAM_EPS, weight_decay=0.0)
    out = {"loss": [], "grad_norm": [], "kl": []}
    for examples in kto_check.example_batches(200):
        parts = [_parts(e) for e in examples]
        with torch.no_grad():
            terms = [_completion_logp(model, parts[i][0], parts[i - 1][1])
                     - _completion_logp(reference, parts[i][0], parts[i - 1][1])
                     for i in range(len(parts))]
            kl = torch.stack(terms).mean().clamp(min=0)
        loss = 0.0
        for e, (prompt, completion) in zip(examples, parts):
            with torch.no_grad():
                ref = _completion_logp(reference, prompt, completion)
            z = _completion_logp(model, prompt, completion) - ref
            if e.label:
                term = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (z - kl)))
            else:
                term = cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl - z)))
            loss = loss + term / len(examples)
        opt.zero_grad()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        out["loss"].append(float(loss.detach()))
        out["kl"].append(float(kl))
    return out


def trl_rows() -> list[dict]:
    """The harness's examples as TRL's tokenized unpaired rows, in batch order."""
    rows = []
    for examples in kto_check.example_batches(200):
        for e in examples:
            prompt, completion = _parts(e)
            rows.append({"prompt_ids": prompt, "completion_ids": completion,
                         "label": e.label})
    return rows


def trl_run(policy_dir: str, reference_dir: str, flags: dict, tokenizer, out_dir: str,
            monkeypatch) -> tuple[list[float], list[dict]]:
    """(per-step losses, per-step logged rows) of trl 1.16's KTOTrainer on trl_rows(): its
    tokenisation bypassed (KTOTrainer._prepare_dataset replaced by the rows plus the one step
    of it that matters here, TRL's own `add_kl_completion_ids`: a batched map of batch size
    per_device_train_batch_size giving each row the previous row's completion, the first row
    the last's), fp32, the same reference model (on the fly), AdamW, clip 1, sequential
    sampling, one batch of kto_check.EXAMPLES per step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    def prepare(self, dataset, processing_class, args, name):
        def add_kl_completion_ids(examples):   # trl/trainer/kto_trainer.py, verbatim
            examples["KL_completion_ids"] = ([examples["completion_ids"][-1]]
                                             + examples["completion_ids"][:-1])
            return examples

        return dataset.map(add_kl_completion_ids, batched=True,
                           batch_size=args.per_device_train_batch_size)

    monkeypatch.setattr(KTOTrainer, "_prepare_dataset", prepare)
    losses, rows = [], []

    class Record(KTOTrainer):   # the loss unrounded
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss.detach()))
            return loss

    class Rows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                rows.append(dict(logs))

    cfg = kto_check.run_cfg(flags).kto
    args = KTOConfig(output_dir=out_dir, per_device_train_batch_size=kto_check.EXAMPLES,
                     learning_rate=harness.LR, lr_scheduler_type="constant", adam_beta1=0.9,
                     adam_beta2=0.95, adam_epsilon=harness.ADAM_EPS, weight_decay=0.0,
                     max_grad_norm=1.0, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                     undesirable_weight=cfg.undesirable_weight, max_steps=kto_check.STEPS,
                     logging_steps=1, report_to=[], use_cpu=True, max_length=None,
                     train_sampling_strategy="sequential", save_strategy="no",
                     optim="adamw_torch", dataloader_num_workers=0, bf16=False)
    trainer = Record(model=AutoModelForCausalLM.from_pretrained(policy_dir),
                     ref_model=AutoModelForCausalLM.from_pretrained(reference_dir), args=args,
                     train_dataset=Dataset.from_list(trl_rows()), processing_class=tokenizer,
                     callbacks=[Rows()])
    trainer.train()
    return losses, rows
