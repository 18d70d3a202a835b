"""Render a conversation with the target's own chat template and mark the assistant tokens for the loss.

    ex = render_example(tokenizer, messages, max_length=2048)   # Example(input_ids, loss_mask)

The mask is found from the rendered *text*, not from template-specific token offsets, so it works for any
template: each assistant message's content is located in the rendered string (searching forward message by
message, so repeated text is handled), the string is tokenized with offsets, and every token overlapping an
assistant span gets mask 1. The tokens right after each reply, up to and including the end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, the tokenizer's eos ...), get mask 1 too: the head must learn to
predict where the turn ends.

A row that cannot be rendered raises `SkipRow` with a reason (`too_long`, `template_error`,
`assistant_not_found`, `no_assistant_tokens`); the caller counts it and moves on. A tokenizer without a chat
template raises `DataError`: nothing can be rendered with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import jinja2

from data_prep.sources import DataError

# End-of-turn markers of common chat templates. The tokenizer's eos is not always the one the template writes
# after a reply (Gemma's eos is <eos>, its turns end with <end_of_turn>), so these count as ends too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "</s>", "<eos>", "<|END_OF_TURN_TOKEN|>")


@dataclass
class Example:
    """One training row: token ids and a 0/1 mask that is 1 where the token belongs to an assistant reply."""

    input_ids: list[int]
    loss_mask: list[int]


class SkipRow(Exception):
    """A row that cannot become an Example; `reason` is the key the caller counts it under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def check_chat_template(tokenizer) -> None:
    """Raise DataError unless the tokenizer carries a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {tokenizer_name(tokenizer)!r} has no chat template; "
                        f"use the tokenizer of a chat/instruct model")


def end_token_ids(tokenizer, extra: Iterable[int] = ()) -> set[int]:
    """Ids that end an assistant turn: the tokenizer's eos, known end-of-turn markers it has, and `extra`."""
    ids = set(extra)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # Token by token, not through get_vocab(): that builds the whole vocabulary dict (~50 ms for 50k tokens).
    for name in END_OF_TURN_TOKENS:
        idx = tokenizer.convert_tokens_to_ids(name)
        if idx is not None and tokenizer.convert_ids_to_tokens(idx) == name:  # unknown names map to unk
            ids.add(idx)
    return ids


def _special_ids(tokenizer) -> set[int]:
    """Ids of special/added control tokens: an end-of-turn search stops at the first of them."""
    ids = set(tokenizer.all_special_ids)
    for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(idx)
    return ids


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    """Character span of `content` in `text` at or after `start`, allowing for templates that trim it.

    Llama-3 and Gemma templates write `content | trim`; ChatML writes it verbatim. Whichever form occurs first
    is the one the template wrote (the other, if found at all, is further on, inside a later message).
    """
    exact = text.find(content, start) if content else -1
    stripped = content.strip()
    loose = text.find(stripped, start) if stripped else -1
    if exact != -1 and (loose == -1 or exact <= loose):
        return exact, exact + len(content)
    if loose != -1:
        return loose, loose + len(stripped)
    return None


def assistant_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in the rendered `text`, located message by message.

    Every message is searched in order so that a user message quoting an earlier reply cannot be mistaken for
    the next reply. System and user messages that a template rewrites (e.g. merged or prefixed) may not be
    found verbatim; they are skipped without moving the cursor. An assistant message that cannot be found
    raises SkipRow: its mask would be wrong.
    """
    spans = []
    cursor = 0
    for m in messages:
        span = _find_content(text, m["content"], cursor)
        if m["role"] == "assistant":
            if span is None:
                raise SkipRow("assistant_not_found", m["content"][:40])
            spans.append(span)
        if span is not None:
            cursor = span[1]
    return spans


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's rendering of `messages`; a template that rejects the row raises SkipRow."""
    check_chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        # e.g. "Conversation roles must alternate user/assistant/user/assistant/..."
        raise SkipRow("template_error", str(e)) from None


def render_example(tokenizer, messages: list[dict], max_length: int,
                   end_ids: Iterable[int] | None = None) -> Example:
    """Render `messages` with the tokenizer's chat template into an Example (see module docstring).

    `end_ids` adds end-of-turn ids (e.g. the target's generation eos ids) to those of `end_token_ids`.
    Raises SkipRow("too_long") when the rendered row has more than `max_length` tokens: rows are skipped, never
    truncated, so no reply is cut in the middle.
    """
    text = render_text(tokenizer, messages)
    spans = assistant_spans(text, messages)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if len(ids) > max_length:
        raise SkipRow("too_long", f"{len(ids)} > {max_length} tokens")

    ends = end_token_ids(tokenizer, end_ids or ())
    specials = _special_ids(tokenizer) | ends
    mask = [0] * len(ids)
    t = 0  # token cursor: spans are in order, so one pass over the tokens covers them all
    for s, e in spans:
        while t < len(ids) and offsets[t][1] <= s:
            t += 1
        last = None
        while t < len(ids) and offsets[t][0] < e:
            if offsets[t][1] > offsets[t][0]:  # a zero-width token overlaps nothing
                mask[t] = 1
                last = t
            t += 1
        if last is None:
            continue
        # Whitespace between the reply and its end-of-turn marker (usually none), then the marker itself. If
        # text or a control token other than an end marker comes first (a template that writes no end
        # marker), nothing extra is marked.
        j = last + 1
        while j < len(ids) and ids[j] not in specials and not text[offsets[j][0]:offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in ends:
            for k in range(last + 1, j + 1):
                mask[k] = 1
            t = max(t, j + 1)
    if not any(mask):
        raise SkipRow("no_assistant_tokens")
    return Example(input_ids=list(ids), loss_mask=mask)
