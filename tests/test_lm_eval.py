"""lm-evaluation-harness 0.4.13 (the real client, from the registry) evaluates a checkpoint
through `serve` (engine.serve; docs/agents.md, "Serving a checkpoint") on two local tasks,
nothing downloaded:
- a generate task (`generate_until`, greedy, `local-completions`, batch size 2 so prompts go in
  lists): its exact-match accuracy equals the one computed directly from transformers' own
  greedy generation of the same prompt ids;
- a multiple-choice log-likelihood task (`local-completions` with echo, logprobs and
  max_tokens 1, batch size 2, the tokenizer read from serve's /tokenizer_info and /tokenize):
  every choice's log-likelihood equals transformers' fp32 log_softmax sum of the same ids
  (1e-4), and so does the accuracy.
The targets are built from the model itself (half the items right by construction), so the
expected accuracies are neither 0 nor 1 and a wrong server answer changes them."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.test_serve import model_dir, served  # noqa: F401  (the served tiny model)

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra (setup.py)")

QUESTIONS = ["w12 w40 w7", "w3 w9", "w100 w101 w102 w103", "w5", "w77 w78", "w60 w61 w62",
             "w20 w21", "w150 w151 w152"]
CHOICES = ["w30", "w31 w32", "w33", "w34 w35 w36"]


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy_text(model, tok, prompt: str, new: int) -> str:
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    whole = tok.decode(out[0], skip_special_tokens=True)       # the continuation's text, as
    return whole[len(tok.decode(ids[0], skip_special_tokens=True)):]   # vLLM returns it


def loglikelihood(model, tok, context: str, continuation: str) -> float:
    """lm-eval's pair encoding (whole text, context prefix) scored with log_softmax in fp32."""
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n = len(tok(context, add_special_tokens=False).input_ids)
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float()[0], -1)
    return float(sum(logp[i - 1, whole[i]] for i in range(n, len(whole))))


def write_task(folder, name: str, rows: list[dict], spec: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{spec}")


def evaluate(endpoint, tasks_dir, task: str, **model_args) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = dict(base_url=f"{endpoint.base_url}/completions", model="tiny", num_concurrent=1,
                max_retries=1, tokenized_requests=True, **model_args)
    out = simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                          batch_size=2, log_samples=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(tasks_dir),
                                                   include_defaults=False))
    return out


@pytest.fixture
def offline(monkeypatch):
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")


def test_lm_eval_generate_task_equals_transformers_greedy(served, model_dir, tmp_path,
                                                          offline):
    """exact_match through serve == exact_match of transformers' greedy texts (the targets:
    the greedy text for even items, a wrong word for odd ones: 0.5 by construction)."""
    endpoint, _, tok = served
    model = transformers_model(model_dir)
    greedy = [greedy_text(model, tok, q, 4) for q in QUESTIONS]
    rows = [{"q": q, "target": g if i % 2 == 0 else g + " w199"}
            for i, (q, g) in enumerate(zip(QUESTIONS, greedy))]
    write_task(tmp_path, "tiny_gen", rows, (
        "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{target}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: ['<|im_end|>']\n"
        "  max_gen_toks: 4\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"))
    out = evaluate(endpoint, tmp_path, "tiny_gen", tokenizer_backend="huggingface",
                   tokenizer=model_dir)
    samples = out["samples"]["tiny_gen"]
    assert len(samples) == len(QUESTIONS)
    got = {s["doc"]["q"]: s["filtered_resps"][0] for s in samples}
    direct = sum(g == r["target"] for g, r in zip(greedy, rows)) / len(rows)
    assert direct == 0.5
    assert [got[q] for q in QUESTIONS] == greedy
    assert out["results"]["tiny_gen"]["exact_match,none"] == direct


def test_lm_eval_multiple_choice_log_likelihoods_equal_transformers(served, model_dir,
                                                                    tmp_path, offline):
    """Every (context, choice) log-likelihood lm-eval reads from serve's echo + logprobs
    equals transformers' (1e-4); acc equals the direct accuracy. The gold answers: the most
    likely choice for even items, the least likely for odd ones."""
    endpoint, _, tok = served
    model = transformers_model(model_dir)
    direct = [[loglikelihood(model, tok, q, " " + c) for c in CHOICES] for q in QUESTIONS]
    gold = [max(range(4), key=lls.__getitem__) if i % 2 == 0 else
            min(range(4), key=lls.__getitem__) for i, lls in enumerate(direct)]
    rows = [{"q": q, "gold": g} for q, g in zip(QUESTIONS, gold)]
    write_task(tmp_path, "tiny_mc", rows, (
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        f"doc_to_choice: {json.dumps(CHOICES)}\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n"))
    out = evaluate(endpoint, tmp_path, "tiny_mc", tokenizer_backend="remote")
    assert len(out["samples"]["tiny_mc"]) == len(QUESTIONS)
    for s in out["samples"]["tiny_mc"]:
        lls = [r[0] for r in s["filtered_resps"]]
        assert lls == pytest.approx(direct[QUESTIONS.index(s["doc"]["q"])], abs=1e-4)
    acc = sum(max(range(4), key=lls.__getitem__) == g for lls, g in zip(direct, gold))
    assert acc / len(rows) == 0.5
    assert out["results"]["tiny_mc"]["acc,none"] == 0.5
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
