"""The model's chat template rules the agent server needs, probed once per tokenizer: rendering
a new trajectory's prompt (engine.data.render.render_prompt, as RL prompts are rendered), the
observation ids after an assistant turn (engine.data.observation: the template delta), the
end-of-turn marker that closes a turn the model did not close itself, the family's tool-call
format, and the text a reply returns (no special tokens, no end-of-turn marker).
"""
from __future__ import annotations

from engine.api.requests import bad
from engine.data.files import DataError
from engine.data.observation import observation_ids
from engine.data.render import chat_template_text, render_prompt, template_info
from engine.data.tool_calls import detect_format
from engine.errors import RunError


LEAD_IDS = 6   # context ids a completion's text is decoded after (continuation_lead)


class TemplateRules:
    """`tokenizer`'s rules (module docstring); `problem` says why chat calls cannot be served
    (no chat template), None when they can."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.vocab_size = tokenizer, len(tokenizer)
        self.problem: str | None = None
        self.tool_format: str | None = None
        self.close_ids: list[int] = []
        try:
            info = template_info(tokenizer)
            self.tool_format = detect_format(chat_template_text(tokenizer))
        except DataError as e:
            self.problem = str(e)
            return
        if info.end_of_turn:
            self.close_ids = list(tokenizer.encode(info.end_of_turn, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A new trajectory's context: the chat rendered with the generation prompt."""
        if self.problem:
            raise bad(f"chat completions are not served: {self.problem}")
        try:
            return render_prompt(messages, self.tokenizer, "request", tools)
        except DataError as e:
            raise bad(str(e), "messages") from None

    def observation_ids(self, before: list[dict], new: list[dict],
                        tools: list[dict] | None) -> list[int]:
        """Ids of `new` after an assistant turn closing `before`, with the next assistant
        header (the template delta of docs/multi-turn.md)."""
        try:
            return observation_ids(self.tokenizer, before, new, tools)
        except (RunError, DataError) as e:
            raise bad(f"the new messages cannot be placed after the earlier turn: {e}",
                      "messages") from None
        except Exception as e:  # noqa: BLE001 - jinja raise_exception in the template
            raise bad(f"chat template failed on the new messages: {e}", "messages") from None

    def closing_ids(self, sampled: list[int]) -> list[int]:
        """What closes a turn whose sampled ids do not end with the end-of-turn marker (cut at
        max_tokens or a stop string, or ended by another end-of-sequence id): the marker's
        ids, trained with mask 0; [] for a turn the model closed itself."""
        n = len(self.close_ids)
        return [] if n and sampled[-n:] == self.close_ids else list(self.close_ids)

    def text_ids(self, text: str, first: bool) -> list[int]:
        """Ids of completion text: a new prompt with the tokenizer's special tokens (bos),
        an extension of earlier ids without."""
        return list(self.tokenizer.encode(text, add_special_tokens=first))

    def check_ids(self, ids: list[int]) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise bad(f"prompt has token ids beyond the vocabulary ({self.vocab_size})",
                      "prompt")

    def reply_text(self, ids: list[int], lead: list[int] | None = None) -> str:
        """The text a reply returns: decoded without special tokens, without a final
        end-of-turn marker. With `lead` (a completion's last context ids: continuation_lead),
        the text the ids add after the lead's text, as vLLM's incremental detokenizer returns
        a completion: decode(lead + ids) past decode(lead), so a word-level or SentencePiece
        tokenizer's space before the first reply token is kept (prompt + text spells the
        whole sequence); decoded alone when the lead's text is not a prefix of it."""
        n = len(self.close_ids)
        if n and ids[-n:] == self.close_ids:
            ids = ids[:-n]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not lead or not ids:
            return text
        head = self.tokenizer.decode(lead, skip_special_tokens=True)
        whole = self.tokenizer.decode(list(lead) + list(ids), skip_special_tokens=True)
        return whole[len(head):] if whole.startswith(head) else text

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def continuation_lead(context: list[int]) -> list[int]:
    """The context ids a completion's text is decoded after (TemplateRules.reply_text): its
    last LEAD_IDS ids (what a token's leading space or merge depends on; vLLM's incremental
    detokenizer reads a window of the same kind)."""
    return list(context[-LEAD_IDS:])
