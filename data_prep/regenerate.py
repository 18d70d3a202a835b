"""Rewrite the assistant replies of conversations with the target's own greedy responses.

A draft head learns to predict the *target*; replies written by another model (ChatGPT in ShareGPT) teach it a
different distribution. Regenerating them with the target raises acceptance (the EAGLE authors and SpecForge
do this).

    convs = regenerate(target, convs, max_new_tokens=256, max_turns=1)

It works turn by turn: reply k of every conversation is generated from the conversation so far (user turns
plus the replies already regenerated), rendered with `add_generation_prompt=True`. The prompts of one turn are
sorted by length and batched with left padding, so a batch wastes little compute on padding. Existing
assistant replies are discarded; prompt files (`turns`, user turns only) get one reply per user turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from data_prep.render import SkipRow, check_chat_template, render_text
from eagle.fastlinear import disable_fast_linear, enable_fast_linear, fast_linear_enabled


@dataclass
class RegenResult:
    """Regenerated conversations (same order and length as the input) and what happened on the way."""

    conversations: list[list[dict]]
    replies: int = 0                 # replies generated
    new_tokens: int = 0              # tokens generated, up to and including the end token
    hit_max_new_tokens: int = 0      # replies cut by max_new_tokens (kept: the text is still the target's)
    ended: list[str | None] = field(default_factory=list)  # per conversation: why it ended early, or None
    seconds: float = 0.0


def _user_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(leading system messages, user messages) of a normalized conversation; assistant replies are dropped."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    return head, [m for m in messages if m["role"] == "user"]


def _generate_batch(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                    eos: set[int]) -> list[tuple[list[int], bool]]:
    """Greedy continuations of token-id prompts: [(new ids up to and including eos, hit eos?)]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        input_ids[r, width - len(p):] = torch.tensor(p)
        attention[r, width - len(p):] = 1
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=sorted(eos),
    )
    results = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        results.append((row if stop is None else row[: stop + 1], stop is not None))
    return results


def regenerate_with_stats(target, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32,
                          max_prompt_tokens: int = 1024, max_turns: int | None = 1) -> RegenResult:
    """Like `regenerate`, returning counts too. A conversation whose prompt for turn k is longer than
    `max_prompt_tokens`, that the template rejects, or whose reply k is empty, ends before user turn k (the reason
    is in `ended`); one that ends
    before its first reply is returned without any assistant message, and the caller drops it."""
    tok = target.tokenizer
    check_chat_template(tok)
    eos = set(target.eos_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else target.eos_ids[0]
    t0 = time.perf_counter()

    parts = [_user_turns(c) for c in conversations]
    done = [list(head) for head, _ in parts]  # the regenerated conversations, grown turn by turn
    active = [i for i, (_, users) in enumerate(parts) if users]
    result = RegenResult(conversations=done, ended=[None] * len(conversations))
    n_turns = max((len(u) for _, u in parts), default=0)
    if max_turns is not None:
        n_turns = min(n_turns, max_turns)

    total = sum(min(len(u), n_turns) for _, u in parts)
    bar = tqdm(total=total, desc="regenerate", unit="reply")
    patched = target.device.type == "cpu" and not fast_linear_enabled(target.model)
    if patched:  # batched decoding steps multiply each weight by <= batch_size rows: the measured layouts help
        enable_fast_linear(target.model)
    try:
        _regenerate_turns(target, parts, done, active, result, bar, n_turns, max_new_tokens, batch_size,
                          max_prompt_tokens, pad_id, eos, t0)
    finally:
        if patched:
            disable_fast_linear(target.model)
    bar.close()
    result.seconds = time.perf_counter() - t0
    return result


def _regenerate_turns(target, parts, done, active, result, bar, n_turns, max_new_tokens, batch_size,
                      max_prompt_tokens, pad_id, eos, t0) -> None:
    tok = target.tokenizer
    with torch.inference_mode():
        for k in range(n_turns):
            # 1. This turn's prompts: the conversation so far plus user turn k, ending in the generation prompt.
            prompts = []
            for i in active:
                users = parts[i][1]
                if k >= len(users):
                    continue
                try:
                    text = render_text(tok, done[i] + [users[k]], add_generation_prompt=True)
                except SkipRow as e:
                    reason = e.reason
                else:
                    ids = tok(text, add_special_tokens=False)["input_ids"]
                    reason = "prompt_too_long" if len(ids) > max_prompt_tokens else None
                if reason is not None:
                    result.ended[i] = reason
                    bar.total -= min(len(users), n_turns) - k
                    continue
                prompts.append((i, ids))
            # 2. Similar lengths in one batch waste little on padding.
            prompts.sort(key=lambda p: len(p[1]))
            still = []
            for b in range(0, len(prompts), batch_size):
                batch = prompts[b: b + batch_size]
                outs = _generate_batch(target, [ids for _, ids in batch], max_new_tokens, pad_id, eos)
                # 3. Decode, then extend each conversation by the user turn and the target's reply.
                for (i, _), (new, hit_eos) in zip(batch, outs):
                    result.new_tokens += len(new)
                    result.hit_max_new_tokens += not hit_eos
                    reply = tok.decode(new, skip_special_tokens=True).strip()
                    users = parts[i][1]
                    if not reply:
                        result.ended[i] = "empty_reply"
                        bar.total -= min(len(users), n_turns) - k - 1
                    else:
                        done[i] += [users[k], {"role": "assistant", "content": reply}]
                        result.replies += 1
                        still.append(i)
                    bar.update(1)
                elapsed = time.perf_counter() - t0
                bar.set_postfix(tok_s=f"{result.new_tokens / max(elapsed, 1e-9):.1f}", turn=k + 1)
            active = sorted(still)


def regenerate(target, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32,
               max_prompt_tokens: int = 1024, max_turns: int | None = 1) -> list[list[dict]]:
    """Replace each conversation's assistant replies by the target's greedy replies (see module docstring).

    Only the first `max_turns` user turns are answered (None answers all); the rest of each conversation is
    dropped. The result has the same length and order as `conversations`; see `regenerate_with_stats` for the
    conversations that end early.
    """
    return regenerate_with_stats(target, conversations, max_new_tokens, batch_size, max_prompt_tokens,
                                 max_turns).conversations
