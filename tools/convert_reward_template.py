"""The exported reward model's calling convention, checked by `verify`
(docs/preference.md#calling-the-exported-reward-model).

The files a reward model's export holds beyond its tensors (config.json, the scoring
`chat_template.jinja`, README.md) are written by engine.rm.export, which mcore-to-hf and a
`checkpoint.save_hf` run of engine.rm share (its names are imported here for the tools and
their tests). Here: `verify`'s chats (`chat_inputs`, `checkpoint_chat_scores`,
`report_chats`): chats rendered by a folder's own `apply_chat_template` against the
checkpoint's scores of the end-of-turn token the engine scores.
"""
from __future__ import annotations

from engine.rm.export import (MARK, PROBE, end_and_trailer, end_of_turn_id,  # noqa: F401
                              scoring_template, write_scoring_files)
from engine.rm.scoring import chat_scored_ids

# verify's chats (tools/convert_reward.verify_scores): one and two turns, words every tokenizer
# has (the tiny demo tokenizer included)
VERIFY_CHATS = [PROBE, [{"role": "user", "content": "what is 2 + 3 ?"},
                        {"role": "assistant", "content": "the answer is 5"},
                        {"role": "user", "content": "and 4 + 4 ?"},
                        {"role": "assistant", "content": "8"}]]


def chat_inputs(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(the ids the engine scores, the ids `tokenizer.apply_chat_template` gives) of
    VERIFY_CHATS; both empty when the tokenizer has no chat template the engine renders."""
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
