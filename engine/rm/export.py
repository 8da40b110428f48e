"""A reward model's Hugging Face folder beyond its tensors: the files `tools/convert.py
mcore-to-hf` and a `checkpoint.save_hf` run of engine.rm both write, by this one code
(docs/preference.md#calling-the-exported-reward-model,
docs/checkpoints.md#hugging-face-folders-during-training).

A reward model trained by engine.rm scores the end-of-turn token of the reply (`<|im_end|>`,
`<|eot_id|>`: engine.rm.scoring), and transformers' sequence classifier scores the last token
of what it is given. ChatML templates render a chat ending in an assistant turn as
`...<|im_end|>\\n`, so `apply_chat_template` as transformers' docs show it would hand the model
the untrained newline (TRL's RewardTrainer trains on that newline; this engine trains on the
token RL's responses end on). The export therefore holds:

- `config.json` (`export_config`): the one-label sequence classifier with a pad_token_id;
- `chat_template.jinja` (which transformers loads before tokenizer_config.json's template):
  the checkpoint's template, unchanged for every other rendering, except that a chat whose last
  message is the assistant's, rendered without a generation prompt, ends on the end-of-turn
  token (what follows it, the "trailer", is dropped). Its `{% generation %}` tags become plain
  blocks (inside the capture that drops the trailer transformers' assistant mask would be
  wrong). Written only when the template renders a trailer, and only after a check: the
  template's ids of a probe chat are the ids the engine scores (`scoring_template`);
- `README.md`: how to call it (transformers, `megatron-sft-engine rm score`);

and `pad_problem` says why an export would be scored at the wrong token (refused by name).
`hf_extras()`: these as engine.checkpoint.hf_export.ExportExtras, which the RM run hands to
its checkpoint saves (engine.checkpoint imports no objective); `validate_rm_run`: the RM
entry point's validation, with checkpoint.save_hf's refusals (`save_hf_problems`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from engine.checkpoint.hf_export import ExportExtras
from engine.config.rm_settings import validate_rm
from engine.config.schema import raise_problems
from engine.rm.scoring import chat_scored_ids
from models.bridge.reward_model import reward_model_hf_config

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



def end_of_turn_id(tokenizer) -> int | None:
    """The id a reward model trained by engine.rm scores at the end of a reply: the last id
    the engine reads of a one-turn chat rendered with the tokenizer's chat template
    (engine.rm.scoring, as training renders sides). `<|im_end|>` for ChatML, `<|eot_id|>` for
    Llama 3.1. None when the tokenizer renders no such chat."""
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


def write_scoring_files(out: Path, ckpt_hf: Path, shown: Path | None = None) -> str:
    """Write `out`/chat_template.jinja (when needed) and `out`/README.md for the reward model
    exported to `out`, whose checkpoint tokenizer is in `ckpt_hf` (module docstring); return
    what was done, one sentence for the conversion's output. `shown`: the folder's path the
    README's example names (default `out`; checkpoint.save_hf writes into a staging folder
    that is renamed when the checkpoint is published)."""
    try:
        note, end = _write_template(Path(out), Path(ckpt_hf))
    except Exception as e:  # noqa: BLE001 - the weights are written; the template is a courtesy
        note, end = (f"the chat template is kept: it could not be checked here "
                     f"({type(e).__name__}: {e}); make ids end on the end-of-turn token"), None
    arch = (json.loads((Path(out) / "config.json").read_text()).get("architectures") or ["?"])[0]
    (Path(out) / "README.md").write_text(README.format(
        arch=arch, out=shown if shown is not None else out,
        end=repr(end or "<the end-of-turn token>"),
        template=f"Its chat template: {note}."))
    return note


def _write_template(out: Path, ckpt_hf: Path) -> tuple[str, str | None]:
    """(what was done, the end-of-turn token's text or None) for chat_template.jinja."""
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



def export_config(cfg: dict, meta_dir: Path, tag: str = "convert") -> dict:
    """config.json of a reward model's export: the one-label sequence classifier, with the
    config's pad_token_id, else that of the tokenizer in `meta_dir` (the checkpoint's source
    folder: models.bridge.checkpoint.source_dir; transformers' sequence classifiers need one
    to score batches of more than one sequence: they score the last token that is not the pad
    id). Prints `[tag]` notes on which. A pad id equal to the end-of-turn id the model scores
    is refused before this (`pad_problem`: mcore-to-hf before any weight is read, a
    checkpoint.save_hf run before it starts)."""
    out = reward_model_hf_config(cfg)
    if out.get("pad_token_id") is None:
        pad = _tokenizer_pad_id(Path(meta_dir))
        if pad is not None:
            out["pad_token_id"] = pad
            print(f"[{tag}] pad_token_id={pad}: the tokenizer's pad token (config.json has "
                  "none)", flush=True)
        else:
            print(f"[{tag}] note: no pad_token_id in config.json or the tokenizer: "
                  "transformers' sequence classifier then scores one sequence per batch",
                  flush=True)
    return out


def pad_problem(cfg: dict, folder: Path, then: str = "convert again") -> str | None:
    """Why the export of a reward model with the HF config `cfg` and the tokenizer files in
    `folder` (a checkpoint's source folder, or a run's model.hf_path) would be scored at the
    wrong token (None: it would not): config.json's pad_token_id or the tokenizer's pad token
    (copied into the export) is the end-of-turn id the model scores (`end_of_turn_id`).
    transformers' sequence classifier scores the last token that is not pad_token_id, so a
    sequence ending on that token would be scored at the token before it. `then`: what the
    message's fix ends with."""
    folder = Path(folder)
    tokenizer = tokenizer_in(folder)
    eot = end_of_turn_id(tokenizer) if tokenizer is not None else None
    if eot is None:
        return None
    sources = {"config.json's pad_token_id": cfg.get("pad_token_id"),
               "the tokenizer's pad token": tokenizer.pad_token_id}
    bad = [name for name, pad in sources.items() if pad is not None and int(pad) == eot]
    if not bad:
        return None
    others = [t for t in tokenizer.all_special_tokens
              if tokenizer.convert_tokens_to_ids(t) != eot]
    hint = sorted(others, key=lambda t: "pad" not in t.lower())[:1]
    return (f"pad_token_id={eot} ({' and '.join(bad)} in {folder}) is "
            f"{tokenizer.convert_ids_to_tokens(eot)!r}, the end-of-turn token the reward model "
            "scores: transformers' sequence classifier scores the last token that is not "
            "pad_token_id, so it would score the token before it. Set pad_token_id in "
            f"{folder / 'config.json'} and the tokenizer's pad_token in "
            f"{folder / 'tokenizer_config.json'} to a token that never ends a scored sequence"
            + (f" (e.g. {hint[0]!r}, id {tokenizer.convert_tokens_to_ids(hint[0])})"
               if hint else "") + f", then {then}")


def tokenizer_in(folder: Path):
    """The tokenizer in `folder` (None: none, or it does not load)."""
    if not (Path(folder) / "tokenizer_config.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None


def _tokenizer_pad_id(folder: Path) -> int | None:
    """The pad token id of the tokenizer files in `folder` (None: none, or no tokenizer)."""
    tokenizer = tokenizer_in(folder)
    return None if tokenizer is None else tokenizer.pad_token_id


def hf_extras() -> ExportExtras:
    """A reward model's checkpoint.save_hf additions: its config.json (`export_config`) and,
    on rank 0 after the tensors, its chat template and README (`write_scoring_files`), as
    mcore-to-hf writes them (a full model's folder; a LoRA run's peft adapter has none)."""
    return ExportExtras(lambda cfg, meta: export_config(cfg, meta, tag="checkpoint"),
                        write_scoring_files)


def save_hf_problems(cfg, hf_config: dict) -> list[str]:
    """Why a reward-model run's checkpoint.save_hf would not write the folder mcore-to-hf
    writes ([]: it will, or save_hf is off): the pad id `pad_problem` refuses (read from
    model.hf_path, whose tokenizer and config the checkpoints carry; mcore-to-hf refuses it
    for a LoRA checkpoint too). A LoRA run's folder is the peft SEQ_CLS adapter with the score
    head (engine.checkpoint.hf_export.export_adapter_folder, convert's own export)."""
    if not cfg.checkpoint.save_hf:
        return []
    problem = pad_problem(reward_model_hf_config(hf_config), Path(cfg.model.hf_path),
                          then="train again")
    return [f"checkpoint.save_hf=true: {problem}"] if problem else []


def validate_rm_run(cfg, world_size: int) -> dict:
    """engine.config.rm_settings.validate_rm plus `save_hf_problems` (ConfigError listing
    them); before any process group exists. Returns the model's HF config dict."""
    hf_config = validate_rm(cfg, world_size)
    raise_problems(save_hf_problems(cfg, hf_config))
    return hf_config


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
