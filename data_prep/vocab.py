"""The draft vocabulary: the target tokens a head drafts over when it drafts over fewer than all (EAGLE-3's reduced
vocabulary, here for EAGLE-1/2 heads too, where the lm_head dominates the cost of a draft step).

    d2t = draft_vocabulary(rows, target.vocab_size, 4096)                         # the most frequent reply tokens
    d2t = draft_vocabulary(rows, V, 4096, tokenizer=tok, also="sharegpt", also_rows=20000)   # weighed with more text

`rows` are prepared training rows (input ids and the assistant loss mask). A few hundred regenerated rows miss
many tokens the target writes, so `also` names a larger source of conversations whose assistant turns are counted
as plain text (no regeneration: a cheap sample of the replies' vocabulary); each source's frequencies weigh half.
"""

from __future__ import annotations

import torch

from data_prep.sources import load_conversations


def draft_vocabulary(rows, vocab_size: int, n: int, tokenizer=None, also: str = "",
                     also_rows: int = 0) -> torch.Tensor | None:
    """The n most frequent assistant tokens (sorted target ids), or None for the whole vocabulary (n <= 0 or n at
    least the vocabulary)."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.zeros(vocab_size)
    for ids, mask in rows:
        counts.index_add_(0, ids[mask], torch.ones(int(mask.sum())))
    if also:
        extra = assistant_token_counts(tokenizer, also, also_rows, vocab_size)
        if extra.sum() > 0:
            counts = counts / counts.sum().clamp(min=1) + extra / extra.sum()
    return counts.topk(n).indices.sort().values


def assistant_token_counts(tokenizer, spec: str, max_rows: int, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the assistant turns of the first `max_rows` conversations of `spec` (a
    source `load_conversations` reads), tokenized as plain text."""
    convs, _ = load_conversations(spec, max_rows=max_rows)
    texts = [m["content"] for conv in convs for m in conv if m["role"] == "assistant" and m["content"]]
    counts = torch.zeros(vocab_size)
    for i in range(0, len(texts), 256):
        for ids in tokenizer(texts[i:i + 256], add_special_tokens=False).input_ids:
            ids = torch.tensor(ids, dtype=torch.long)
            ids = ids[ids < vocab_size]
            counts.index_add_(0, ids, torch.ones(ids.shape[0]))
    return counts
