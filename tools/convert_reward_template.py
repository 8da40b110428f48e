"""The exported reward model's calling convention (docs/preference.md#calling-the-exported-reward-model).

A reward model trained by engine.rm scores the end-of-turn token of the reply (`<|im_end|>`,
`<|eot_id|>`: engine.rm.scoring), and transformers' sequence classifier scores the last token
of what it is given. ChatML templates render a chat ending in an assistant turn as
`...<|im_end|>\\n`, so `apply_chat_template` as transformers' docs show it would hand the model
the untrained newline (TRL's RewardTrainer trains on that newline; this engine trains on the
token RL's responses end on). mcore-to-hf therefore writes, into a reward model's export:

- `chat_template.jinja` (which transformers loads before tokenizer_config.json's template):
  the checkpoint's template, unchanged for every other rendering, except that a chat whose last
  message is the assistant's, rendered without a generation prompt, ends on the end-of-turn
  token (what follows it, the "trailer", is dropped). Its `{% generation %}` tags become plain
  blocks (inside the capture that drops the trailer transformers' assistant mask would be
  wrong). Written only when the template renders a trailer, and only after a check: the
  template's ids of a probe chat are the ids the engine scores (`scoring_template`);
- `README.md`: how to call it (transformers, `megatron-sft-engine rm score`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

MARK = "megatron-sft-engine reward-model scoring template"
_GENERATION = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")
PROBE = [{"role": "user", "content": "1 + 1 ?"}, {"role": "assistant", "content": "2"}]


def _literal(text: str) -> str:
    """`text` as a Jinja string literal."""
    return json.dumps(text, ensure_ascii=False)


def scoring_template(template: str, end: str, trailer: str) -> str:
    """`template` whose rendering of a chat ending in an assistant message (no generation
    prompt) stops after `end`, the end-of-turn text, dropping `trailer` (the text it renders
    after it). Every other rendering is the template's own: the template is rendered whole into
    a variable (its one trailing newline dropped, as Jinja drops it from a template file; a
    leading newline kept), then printed, cut when it ends with `end + trailer`."""
    if MARK in template or not trailer:
        return template
    body = _GENERATION.sub(lambda m: "{%" + m.group(1) + (" endif " if m.group(2) else
                                                            " if true ") + m.group(3) + "%}",
                           template)
    if body.endswith("\n"):
        body = body[:-1]
    tail = _literal(end + trailer)
    return (f"{{#- {MARK}: the checkpoint's template, except that a chat ending in an "
            "assistant turn ends on its end-of-turn token (the token the reward model scores) "
            "-#}\n"
            "{%- set __rendered %}\n" + body + "{% endset -%}\n"
            "{%- if not add_generation_prompt and messages and "
            f"messages[-1]['role'] == 'assistant' and __rendered.endswith({tail}) -%}}\n"
            f"{{{{- __rendered[:-{len(trailer)}] -}}}}\n"
            "{%- else -%}\n{{- __rendered -}}\n{%- endif -%}\n")


# verify's chats (tools/convert_reward.verify_scores): one and two turns, words every tokenizer
# has (the tiny demo tokenizer included)
VERIFY_CHATS = [PROBE, [{"role": "user", "content": "what is 2 + 3 ?"},
                        {"role": "assistant", "content": "the answer is 5"},
                        {"role": "user", "content": "and 4 + 4 ?"},
                        {"role": "assistant", "content": "8"}]]


def chat_inputs(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(the ids the engine scores, the ids `tokenizer.apply_chat_template` gives) of
    VERIFY_CHATS; both empty when the tokenizer has no chat template the engine renders."""
    from engine.rm.scoring import chat_scored_ids   # the engine's renderer, when verify runs

    if not getattr(tokenizer, "chat_template", None):
        return [], []
    try:
        engine = [chat_scored_ids(chat, tokenizer, "verify's chat") for chat in VERIFY_CHATS]
        called = [list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)
                       ["input_ids"]) for chat in VERIFY_CHATS]
    except Exception:  # noqa: BLE001 - a template that renders no such chat: no chat rows
        return [], []
    return engine, called


def checkpoint_chat_scores(chunks: list, id_lists: list[list[int]]):
    """Collective: the checkpoint's scores [len(id_lists)] (float32, CPU) of each id list's
    last token (right-padded with id 0 into one batch; causal, so padding changes nothing)."""
    import torch   # verify's libraries, loaded when it runs

    from models.build.forward import forward_values

    if not id_lists:
        return torch.zeros(0)
    width = max(map(len, id_lists))
    tokens = torch.tensor([ids + [0] * (width - len(ids)) for ids in id_lists])
    values = forward_values(chunks, tokens).float().cpu()
    return values[torch.arange(len(id_lists)), torch.tensor([len(i) - 1 for i in id_lists])]


def report_chats(engine_ids: list[list[int]], called_ids: list[list[int]], scores, ref,
                 tolerance: float, template) -> bool:
    """Rank 0 of verify: print how transformers' scores `ref` of --hf-dir's
    apply_chat_template ids `called_ids` compare with the checkpoint's `scores` of the ids the
    engine scores `engine_ids`; False (verify fails) when they differ beyond `tolerance` and
    either the ids are the same (the weights differ) or the folder's `template` is this
    engine's scoring template (an export that promises the end-of-turn token). Another
    folder whose template renders past that token (a source of hf-to-mcore, an export written
    before the scoring template) gets a note: called as transformers' docs show, it scores a
    token this engine neither trains nor queries."""
    if not engine_ids:
        return True
    diff = (scores - ref).abs().max().item()
    same = all(a == b for a, b in zip(engine_ids, called_ids))
    print(f"chats rendered by --hf-dir's own apply_chat_template: max_abs_diff={diff:.3e} "
          "against the checkpoint's scores of their end-of-turn token")
    if diff <= tolerance:
        return True
    if same or MARK in (template if isinstance(template, str) else ""):
        return False
    print(f"note: --hf-dir's chat template renders past the end-of-turn token (its ids end on "
          f"id {called_ids[0][-1]}, the checkpoint scores id {engine_ids[0][-1]}): called as "
          "transformers' docs show, that folder scores a token the model is not trained on; "
          "mcore-to-hf of the checkpoint writes a chat template that ends on it")
    return True


def end_of_turn_id(tokenizer) -> int | None:
    """The id a reward model trained by engine.rm scores at the end of a reply: the last id
    the engine reads of a one-turn chat rendered with the tokenizer's chat template
    (engine.rm.scoring, as training renders sides). `<|im_end|>` for ChatML, `<|eot_id|>` for
    Llama 3.1. None when the tokenizer renders no such chat."""
    from engine.rm.scoring import chat_scored_ids   # the engine's renderer, when a tool runs

    try:
        return int(chat_scored_ids(PROBE, tokenizer, "the end-of-turn probe")[-1])
    except Exception:  # noqa: BLE001 - no chat template, or one that refuses this chat
        return None


def end_and_trailer(tokenizer, eot: int) -> tuple[str, str] | None:
    """(the end-of-turn token's text, the text the chat template renders after it) for the
    probe chat; None when the rendering does not hold that token's text."""
    text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    end = tokenizer.convert_ids_to_tokens(eot)
    at = text.rfind(end) if isinstance(end, str) and end else -1
    return None if at < 0 else (end, text[at + len(end):])


def write_scoring_files(out: Path, ckpt_hf: Path) -> str:
    """Write `out`/chat_template.jinja (when needed) and `out`/README.md for the reward model
    exported to `out`, whose checkpoint tokenizer is in `ckpt_hf` (module docstring); return
    what was done, one sentence for the conversion's output."""
    try:
        note, end = _write_template(Path(out), Path(ckpt_hf))
    except Exception as e:  # noqa: BLE001 - the weights are written; the template is a courtesy
        note, end = (f"the chat template is kept: it could not be checked here "
                     f"({type(e).__name__}: {e}); make ids end on the end-of-turn token"), None
    arch = (json.loads((Path(out) / "config.json").read_text()).get("architectures") or ["?"])[0]
    (Path(out) / "README.md").write_text(README.format(
        arch=arch, out=out, end=repr(end or "<the end-of-turn token>"),
        template=f"Its chat template: {note}."))
    return note


def _write_template(out: Path, ckpt_hf: Path) -> tuple[str, str | None]:
    """(what was done, the end-of-turn token's text or None) for chat_template.jinja."""
    from transformers import AutoTokenizer   # tools load transformers only when they run

    from engine.rm.scoring import chat_scored_ids

    if not (out / "tokenizer_config.json").is_file():
        return "no tokenizer was exported: render chats with the base model's template", None
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eot = end_of_turn_id(tokenizer)
    template = tokenizer.chat_template
    found = end_and_trailer(tokenizer, eot) if eot is not None and isinstance(template, str) \
        else None
    if found is None:
        return ("the chat template is kept: no single template that renders an end-of-turn "
                "token after a reply"), None
    end, trailer = found
    if not trailer:
        return (f"the chat template is kept: a chat it renders ends on {end!r}, the token the "
                "model scores"), end
    expected = chat_scored_ids(PROBE, AutoTokenizer.from_pretrained(str(ckpt_hf)), "probe")
    tokenizer.chat_template = scoring_template(template, end, trailer)
    got = tokenizer.apply_chat_template(PROBE, tokenize=True, return_dict=True)["input_ids"]
    if list(got) != list(expected):
        return (f"the chat template is kept (rewritten, it did not give the scored ids of a "
                f"probe chat): make ids end on {end!r} yourself"), end
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    return (f"chat_template.jinja renders a chat ending in an assistant turn through {end!r}, "
            f"the token the model scores (the template's trailing {trailer!r} dropped)"), end


README = """# Reward model (megatron-sft-engine)

A `{arch}` with one label: the score of a chat is the score head's value on the end-of-turn
token {end} of its last assistant turn, the token it was trained on (megatron-sft-engine's
docs/preference.md, "Reward models"). {template}

```python
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

path = "{out}"
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
chat = [{{"role": "user", "content": "what is 2 + 3 ?"}},
        {{"role": "assistant", "content": "the answer is 5"}}]
ids = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
assert tokenizer.convert_ids_to_tokens(ids[0, -1].item()) == {end}   # the scored token
with torch.no_grad():
    print(model(ids).logits[0, 0].item())
```

The same from the command line, for chats or preference rows in a .jsonl file rendered as
training rendered them: `megatron-sft-engine rm score --model {out} --data chats.jsonl`.
Ids that do not end on {end} (a chat rendered by another tokenizer's template, a text ending
in a newline after it) are scored on a token the model was never trained on.
"""
