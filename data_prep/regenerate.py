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

import cpu_backend
from data_prep.journal import Journal
from data_prep.render import SkipRow, check_chat_template, render_text
from eagle.attention import use_gqa_sdpa
from eagle.target import preallocated_cache


@dataclass
class RegenResult:
    """Regenerated conversations (same order and length as the input) and what happened on the way."""

    conversations: list[list[dict]]
    replies: int = 0                 # replies generated
    new_tokens: int = 0              # tokens generated, up to and including the end token
    hit_max_new_tokens: int = 0      # replies cut by max_new_tokens (kept: the text is still the target's)
    ended: list[str | None] = field(default_factory=list)  # per conversation: why it ended early, or None
    # per conversation: the prompt ids and reply of its last regenerated turn (features: in the journal), or None
    last_turn: list[tuple[list[int], Reply] | None] = field(default_factory=list)
    seconds: float = 0.0
    resumed: int = 0                 # replies taken from the journal of a stopped run, not generated again


def prompt_ids(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """The ids of `messages` rendered with the generation prompt: what the target reads before its reply. SkipRow
    when the template rejects them, or ("prompt_too_long") when they are longer than `max_prompt_tokens`."""
    text = render_text(tokenizer, messages, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        raise SkipRow("prompt_too_long")
    return ids


def user_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(leading system messages, user messages) of a normalized conversation; assistant replies are dropped."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    return head, [m for m in messages if m["role"] == "user"]


DEADLINE_CHUNK = 8  # with a deadline, prompts are sorted by length within chunks of this many batches
# tokens (rows x columns) a prefill runs at once: its activations (an 8B target's MLP: ~130 kB a token in bf16) are
# one chunk's, not the whole batch's (64 prompts of 2,000 tokens: 17 GB)
PREFILL_TOKENS = 4096


@dataclass
class Reply:
    """One greedy continuation: the new ids (up to and including the end token), whether an end token came, and
    with `keep_features` the target's post-norm features of prompt + new ids ([P + N, H]; the last row is zeros:
    the last new token is never fed back, and nothing is predicted from it)."""

    new_ids: list[int]
    hit_eos: bool
    features: torch.Tensor | None = None


@torch.inference_mode()
def greedy_replies(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, pad_id: int,
                   eos: set[int], keep_features: bool = False, on_reply=None,
                   deadline: float | None = None, feature_dtype: torch.dtype | None = None) -> list[Reply | None]:
    """Greedy continuations of token-id prompts, in batches of similar length (left padding).

    Our own loop rather than transformers' `generate`: the KV cache is written in place (no copy of the whole
    cache per step), rows that end leave the batch, and the features each pass computes anyway can be
    kept, which saves training a second pass over the same tokens. With 128 rows a step took 0.54 s against
    1.15 s with a concatenating cache (BENCHMARKS.md). `on_reply(i, reply)` is called as each
    prompt's reply is done.

    The prompts run longest first: the batch that needs the most memory comes first (a run that will not fit
    fails at once), and the buffers of later, shorter batches fit where the earlier ones were, so the host memory
    glibc holds does not creep up batch after batch as it did shortest first (+440 MB over 15 batches of a
    3,072-wide target; benchmarks/memory_scale.py). The prefill runs in chunks of `PREFILL_TOKENS`.

    With `keep_features` the features (in `feature_dtype`, default the target's) come to the host once a step for
    the whole batch, into one buffer for the batch; a finished row's reach `on_reply` as a view of that buffer, to
    write away at once (prep's journal: later batches reuse the memory), and are kept, copied, in the returned
    replies only when there is no `on_reply`. Host memory then holds the batch's features, whatever the number of
    prompts.

    With a `deadline` (a `time.perf_counter()` value) no batch starts that would end after it if it took as long as
    the previous batch (so a slow machine does not overrun the budget by a whole batch: minutes at batch 128),
    and the prompts never started get None. The prompts are then sorted by length within chunks of
    `DEADLINE_CHUNK` batches taken in input order, so what gets done is the input's first chunks (and the longer
    prompts of the last one started) rather than the longest prompts of all. Sorting only within each batch cost
    ~30 % of the new tokens per second here (every batch is padded to its longest prompt: 96 against 138 tokens/s
    for the same 256 prompts at batch 128, BENCHMARKS.md).
    """
    out: list[Reply | None] = [None] * len(prompts)
    chunk = max(1, len(prompts)) if deadline is None else DEADLINE_CHUNK * batch_size
    order = [i for c in range(0, len(prompts), chunk)
             for i in sorted(range(c, min(c + chunk, len(prompts))), key=lambda i: -len(prompts[i]))]
    dev = target.device
    fdtype = feature_dtype or target.dtype
    started = None  # when the previous batch started
    for b in range(0, len(order), batch_size):
        if deadline is not None:
            now = time.perf_counter()
            if now >= deadline or (started is not None and now + (now - started) > deadline):
                break
            started = now
        rows = order[b: b + batch_size]
        # 1. Prefill the left-padded prompts; every row's next token is then the last column's argmax.
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            attn[r, width - len(prompts[i]):] = 1
        attn, pos = attn.to(dev), (attn.cumsum(-1) - 1).clamp(min=0).to(dev)
        cache = preallocated_cache()
        # the batch's features on the host, [rows, columns, H], as the prompts and the tokens fill the columns: one
        # buffer a batch (buffers per row, freed at different times, left glibc's heap holding more every batch)
        feats = torch.zeros(len(rows), width + max_new_tokens, target.hidden_size, dtype=fdtype) \
            if keep_features else None
        #    In chunks of about PREFILL_TOKENS (rows x columns): the prefill holds one chunk's activations at a
        #    time, whatever the prompts' length, and each chunk's features come to the host in one copy.
        step = max(1, PREFILL_TOKENS // len(rows))
        for c in range(0, width, step):
            end = min(width, c + step)
            last, _ = target.hidden(ids[:, c:end].to(dev), pos[:, c:end], attn[:, :end], cache)
            if keep_features:
                feats[:, c:end] = last.to("cpu", fdtype)
        nxt = target.logits(last[:, -1]).argmax(-1)
        new = {i: [] for i in rows}
        pos = pos[:, -1]
        live = list(rows)  # the original index of each batch row
        slot = {i: r for r, i in enumerate(rows)}  # a prompt's row of `feats`
        alive = [True] * len(live)
        fed = 0  # decoding steps so far: step k feeds every live row's token k
        while True:
            # 2. Record each row's token; a row that ends (eos or max_new_tokens) is done.
            for r, (i, t) in enumerate(zip(live, nxt.tolist())):
                if not alive[r]:
                    continue
                new[i].append(t)
                if t in eos or len(new[i]) >= max_new_tokens:
                    alive[r] = False
                    # the last column stays zeros: the last new token is never fed back
                    f = feats[slot[i], width - len(prompts[i]): width + len(new[i])] if keep_features else None
                    out[i] = Reply(new[i], t in eos, f.clone() if f is not None and on_reply is None else None)
                    if on_reply is not None:
                        on_reply(i, Reply(new[i], t in eos, f))
            n_alive = sum(alive)
            if n_alive == 0:
                break
            # 3. Done rows leave the batch once they are a quarter of it: dropping copies the whole cache, which
            #    costs about as much as a step, so a few done rows ride along meanwhile (their tokens are unused).
            if len(live) - n_alive >= max(1, len(live) // 4):
                keep = [r for r in range(len(live)) if alive[r]]
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                attn, pos, nxt = attn[sel], pos[sel], nxt[sel]
                live, alive = [live[r] for r in keep], [True] * len(keep)
            # 4. One decoding step.
            attn = torch.cat([attn, attn.new_ones(len(live), 1)], dim=1)
            pos = pos + 1
            last, _ = target.hidden(nxt[:, None], pos[:, None], attn, cache)
            nxt = target.logits(last[:, -1]).argmax(-1)
            fed += 1
            if keep_features:  # one copy a step for the batch, into the column of the token just fed
                feats[[slot[i] for i in live], width + fed - 1] = last[:, -1].to("cpu", fdtype)
    return out


def regenerate_with_stats(target, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32,
                          max_prompt_tokens: int = 1024, max_turns: int | None = 1,
                          max_seconds: float | None = None, journal: Journal | None = None) -> RegenResult:
    """Like `regenerate`, returning counts too. A conversation whose prompt for turn k is longer than
    `max_prompt_tokens`, that the template rejects, whose reply k is empty, or that `max_seconds` of generation
    did not reach, ends before user turn k (the reason is in `ended`); one that ends before its first reply is
    returned without any assistant message, and the caller drops it.

    A `journal` (one turn only, `data_prep.journal`) receives every reply as it is made, with its features when the
    journal has a width; a conversation it already holds is taken from it, not generated again."""
    if journal is not None and max_turns != 1:
        raise ValueError(f"a regeneration journal keeps one-turn replies; max_turns is {max_turns}")
    tok = target.tokenizer
    check_chat_template(tok)
    eos = set(target.eos_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else target.eos_ids[0]
    t0 = time.perf_counter()

    parts = [user_turns(c) for c in conversations]
    done = [list(head) for head, _ in parts]  # the regenerated conversations, grown turn by turn
    active = [i for i, (_, users) in enumerate(parts) if users]
    result = RegenResult(conversations=done, ended=[None] * len(conversations), last_turn=[None] * len(conversations))
    n_turns = max((len(u) for _, u in parts), default=0)
    if max_turns is not None:
        n_turns = min(n_turns, max_turns)

    total = sum(min(len(u), n_turns) for _, u in parts)
    bar = tqdm(total=total, desc="regenerate", unit="reply")
    # a step's left-padded batch brings a mask, with which `sdpa` copies the cache per query head; gqa_sdpa reads it
    # in place (eagle.attention)
    switched = target.model.config._attn_implementation == "sdpa" and use_gqa_sdpa(target.model, True)
    patched = cpu_backend.applies(target.model) and not cpu_backend.enabled(target.model)
    if patched:  # batched decoding steps multiply each weight by <= batch_size rows: the measured layouts help
        cpu_backend.enable(target.model, gguf=target.source)
    try:
        _regenerate_turns(target, parts, done, active, result, bar, n_turns, max_new_tokens, batch_size,
                          max_prompt_tokens, pad_id, eos, t0, journal,
                          None if max_seconds is None else t0 + max_seconds)
    except BaseException:
        if journal is not None:  # a row may be half written: the open shard's rows are made again next time
            journal.abort()
        raise
    else:
        if journal is not None:
            journal.close()
    finally:
        if patched:
            cpu_backend.disable(target.model)
        if switched:
            use_gqa_sdpa(target.model, False)
    bar.close()
    result.seconds = time.perf_counter() - t0
    return result


def _regenerate_turns(target, parts, done, active, result, bar, n_turns, max_new_tokens, batch_size,
                      max_prompt_tokens, pad_id, eos, t0, journal, deadline) -> None:
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
                    prompts.append((i, prompt_ids(tok, done[i] + [users[k]], max_prompt_tokens)))
                except SkipRow as e:
                    result.ended[i] = e.reason
                    bar.total -= min(len(users), n_turns) - k
            # 2. Generate (batches of similar length); extend each conversation by the user turn and the reply.
            still = []

            def finished(j: int, reply: Reply, resumed: bool = False) -> None:
                i = prompts[j][0]
                if resumed:
                    result.resumed += 1
                else:
                    result.new_tokens += len(reply.new_ids)
                    if journal is not None:
                        journal.add(i, prompts[j][1], reply.new_ids, reply.hit_eos, reply.features)
                        reply = Reply(reply.new_ids, reply.hit_eos)  # the features are on the disk now
                result.hit_max_new_tokens += not reply.hit_eos
                text = tok.decode(reply.new_ids, skip_special_tokens=True).strip()
                users = parts[i][1]
                if not text:
                    result.ended[i] = "empty_reply"
                    bar.total -= min(len(users), n_turns) - k - 1
                else:
                    done[i] += [users[k], {"role": "assistant", "content": text}]
                    result.replies += 1
                    result.last_turn[i] = (prompts[j][1], reply)
                    still.append(i)
                bar.update(1)
                bar.set_postfix(tok_s=f"{result.new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}", turn=k + 1,
                                refresh=False)

            # replies the journal holds (a stopped run's) are taken as they were written
            known = [j for j, (i, ids) in enumerate(prompts) if journal is not None and i in journal.done
                     and journal.done[i].prompt == ids]
            for j in known:
                row = journal.done[prompts[j][0]]
                finished(j, Reply(row.new_ids, row.hit_eos), resumed=True)
            todo = sorted(set(range(len(prompts))) - set(known))
            keep = journal is not None and journal.width > 0
            if keep:  # the room their features need at most, before any is made
                journal.expect(sum(len(prompts[j][1]) + max_new_tokens for j in todo), len(todo))
            replies = greedy_replies(target, [prompts[j][1] for j in todo], max_new_tokens, batch_size, pad_id, eos,
                                     keep, lambda t, reply: finished(todo[t], reply), deadline,
                                     journal.dtype if keep else None)
            for j, reply in zip(todo, replies):
                if reply is None:  # the time budget ran out before its batch
                    i = prompts[j][0]
                    result.ended[i] = "time_budget"
                    bar.total -= min(len(parts[i][1]), n_turns) - k
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
