"""How an exported reward model is called (docs/preference.md#calling-the-exported-reward-model):
in process, no launch.

- the export's scoring chat template (tools/convert_reward_template.py) renders a chat ending
  in an assistant turn through its end-of-turn token and nothing after it, for the ChatML,
  Qwen2.5, Qwen3 and tiny demo templates (Llama 3.1 has no trailer: kept), and every other
  rendering (generation prompt, a chat ending on a user turn, multi-turn) exactly as the
  template did; the engine renders the rewritten template to the same trained ids;
- `megatron-sft-engine rm score` (engine.rm.score) scores chats and preference rows on the
  end-of-turn token, as transformers scores the export's apply_chat_template ids; refusals by
  name (not a reward model, a chat that does not end on the reply);
- verify's chat rows (chat_inputs, report_chats): the old template's ids end past the scored
  token (a note), the rewritten one's do not.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.data.render import render_messages
from engine.rm.scoring import chat_scored_ids, scored_length
from tests.launch import run_main
from tests.test_reward_model_convert import build_reward_model
from tools.char_tokenizer import FAMILIES, build_char_tokenizer
from tools.convert_reward import end_of_turn_id
from tools.convert_reward_template import (MARK, chat_inputs, end_and_trailer, report_chats,
                                           scoring_template, write_scoring_files)
from tools.tiny_models import build_tokenizer

REPLY = [{"role": "user", "content": "what is 2 + 3 ?"},
         {"role": "assistant", "content": "the answer is 5"}]
CHATS = [REPLY,
         [{"role": "system", "content": "be brief"}, *REPLY,
          {"role": "user", "content": "and 4 + 4 ?"}, {"role": "assistant", "content": "8"}],
         [{"role": "user", "content": "hi"}],
         [*REPLY, {"role": "user", "content": "more"}]]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    out = {f: build_char_tokenizer(None, f) for f in FAMILIES}
    out["tiny"] = build_tokenizer(str(tmp_path_factory.mktemp("tiny_tok")), 200)
    return out


@pytest.mark.parametrize("family", [*FAMILIES, "tiny"])
def test_scoring_template_ends_a_reply_on_its_end_of_turn_token(tokenizers, family):
    tok = tokenizers[family]
    end, trailer = end_and_trailer(tok, end_of_turn_id(tok))
    assert (end, trailer) == (("<|eot_id|>", "") if family == "llama3.1" else
                              ("<|im_end|>", "\n"))
    new = copy.deepcopy(tok)
    new.chat_template = scoring_template(tok.chat_template, end, trailer)
    assert (MARK in new.chat_template) == bool(trailer)
    for chat in CHATS:
        for gen in (False, True):
            old_text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            new_text = new.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            if chat[-1]["role"] != "assistant" or gen:
                assert new_text == old_text
                continue
            assert new_text == old_text[:len(old_text) - len(trailer)] and new_text.endswith(end)
            ids = new.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
            assert list(ids) == chat_scored_ids(chat, tok, "x")
            old_ids, old_trained = render_messages(chat, tok, "x")
            new_ids, new_trained = render_messages(chat, new, "x")
            n = len(new_ids)
            assert (old_ids[:n], old_trained[:n]) == (new_ids, new_trained)
            assert not any(old_trained[n:]) and n == scored_length(old_trained)
    # idempotent: an export of an export keeps its template
    assert scoring_template(new.chat_template, end, trailer) == new.chat_template


def test_scored_length_is_through_the_last_trained_id():
    assert scored_length([0, 0, 1, 1, 0]) == 4
    assert scored_length([0, 1, 0, 1, 0, 0]) == 4
    assert scored_length([0, 0, 0]) == 3      # nothing trained: read whole


@pytest.fixture(scope="module")
def rm_folders(tmp_path_factory) -> tuple[str, Path]:
    """(a tiny Qwen3 reward model folder with the demo tokenizer, a copy with the export's
    chat template and README)."""
    root = tmp_path_factory.mktemp("calling")
    src = build_reward_model(root / "src", "qwen3")
    out = root / "export"
    shutil.copytree(src, out)
    note = write_scoring_files(out, Path(src))
    assert note.startswith("chat_template.jinja renders a chat ending in an assistant turn "
                           "through '<|im_end|>'"), note
    return src, out


def _hf(folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(folder),
                                                               dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(folder)), model


def _score(model, ids) -> float:
    with torch.no_grad():
        return float(model(torch.as_tensor([list(ids)])).logits[0, 0])


def test_rm_score_scores_the_end_of_turn_token(rm_folders, tmp_path):
    """`rm score` on a chat and a preference row: each score is transformers' score of the
    ids cut after <|im_end|> (3), which are the export's apply_chat_template ids; the source
    template's ids end on the newline (4), a different score."""
    from engine.rm.__main__ import main

    src, export = rm_folders
    rows = tmp_path / "rows.jsonl"
    rejected = [{"role": "assistant", "content": "5 is the answer"}]
    rows.write_text(json.dumps({"messages": REPLY}) + "\n" + json.dumps(
        {"prompt": REPLY[:1], "chosen": REPLY[1:], "rejected": rejected}) + "\n")
    proc = run_main(main, ["score", "--model", str(export), "--data", str(rows)])
    assert proc.returncode == 0, proc.stderr
    first, second = (json.loads(line) for line in proc.stdout.splitlines())
    tok, model = _hf(export)
    called = tok.apply_chat_template(REPLY, tokenize=True, return_dict=True)["input_ids"]
    assert called[-1] == 3 and list(called) == chat_scored_ids(REPLY, tok, "x")
    expected = _score(model, called)
    assert first == {"row": 1, "score": pytest.approx(expected, rel=1e-6)}
    assert second["chosen"] == pytest.approx(expected, rel=1e-6)
    other = _score(model, chat_scored_ids(REPLY[:1] + rejected, tok, "x"))
    assert second["rejected"] == pytest.approx(other, rel=1e-6)
    assert second["margin"] == pytest.approx(expected - other, rel=1e-5)
    assert "scored 2 rows; 1 pair: accuracy" in proc.stderr
    old = _hf(src)[0].apply_chat_template(REPLY, tokenize=True, return_dict=True)["input_ids"]
    assert old[-1] == 4 and abs(_score(model, old) - expected) > 1e-2 * abs(expected)


def test_rm_score_refusals_name_the_problem(rm_folders, qwen3_dir, tmp_path):
    from engine.rm.__main__ import main

    _, export = rm_folders
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": REPLY}) + "\n"
                    + json.dumps({"messages": REPLY[:1]}) + "\n")
    proc = run_main(main, ["score", "--model", str(export), "--data", str(rows)])
    assert proc.returncode == 2 and f"{rows}:2: the last message must be the assistant " \
        "reply to score (found role 'user')" in proc.stderr, proc.stderr
    proc = run_main(main, ["score", "--model", qwen3_dir, "--data", str(rows)])
    assert proc.returncode == 2 and f"--model {qwen3_dir} is not a reward model" in proc.stderr


def test_the_export_readme_snippet_runs(rm_folders, capsys):
    """README.md's python block, run as written, prints the score of the end-of-turn token."""
    _, export = rm_folders
    text = (export / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    tok, model = _hf(export)
    ids = chat_scored_ids([{"role": "user", "content": "what is 2 + 3 ?"},
                           {"role": "assistant", "content": "the answer is 5"}], tok, "x")
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) == pytest.approx(
        _score(model, ids), rel=1e-6)


def test_verify_chat_rows_tell_the_old_template_from_the_export(rm_folders, capsys):
    """chat_inputs on the source template: apply_chat_template's ids end one id past the
    scored one; report_chats notes it (verify passes: an hf-to-mcore source may be called so)
    unless the folder carries the scoring template, where it fails. On the export: the same
    ids."""
    src, export = rm_folders
    engine_ids, called = chat_inputs(_hf(src)[0])
    assert [c[:-1] for c in called] == engine_ids and {c[-1] for c in called} == {4}
    scores, ref = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0])
    assert report_chats(engine_ids, called, scores, ref, 1e-4, "plain")
    assert "note: --hf-dir's chat template renders past the end-of-turn token" in \
        capsys.readouterr().out
    assert not report_chats(engine_ids, called, scores, ref, 1e-4, f"{{# {MARK} #}}")
    engine_ids, called = chat_inputs(_hf(export)[0])
    assert engine_ids == called and {c[-1] for c in called} == {3}


def test_an_export_whose_tokenizer_does_not_load_keeps_its_template(rm_folders, tmp_path):
    """The weights are written before the template is: a tokenizer that does not load here
    leaves the folder's template as it was, says so, and README.md is still written."""
    src, _ = rm_folders
    out = tmp_path / "broken"
    shutil.copytree(src, out)
    (out / "tokenizer.json").write_text("{not json")
    template = (out / "chat_template.jinja").read_text()
    note = write_scoring_files(out, Path(src))
    assert note.startswith("the chat template is kept: it could not be checked here"), note
    assert (out / "chat_template.jinja").read_text() == template
    assert "megatron-sft-engine rm score --model" in (out / "README.md").read_text()
