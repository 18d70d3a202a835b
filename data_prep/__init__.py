"""Data preparation for EAGLE draft heads: conversations in, tokenized rows with assistant loss masks out.

    from data_prep import PrepConfig, prepare
    summary = prepare(PrepConfig(target="smollm2-135m", data="sharegpt", out="runs/data", max_rows=300))
    print(summary.format())

    # or from the shell (keys are PrepConfig fields)
    python -m data_prep target=smollm2-135m data=sharegpt out=runs/data max_rows=300

Modules, in pipeline order:
- sources.py     read ShareGPT / OpenAI `messages` / prompt `turns` rows from JSON, JSONL, Parquet, the hub, or
                 the embedded `sharegpt` package; normalize them and count what is dropped, by reason.
- regenerate.py  optionally rewrite the assistant replies with the target's own greedy replies.
- render.py      render with the target's chat template; loss mask = the assistant tokens, found from the text.
- prep.py        the whole step: split off validation rows and write train.jsonl, val.jsonl, a summary.
- vocab.py       the draft vocabulary: the most frequent assistant tokens of the prepared rows.

This package imports only from `eagle`.
"""

from data_prep.prep import PrepConfig, PrepSummary, iter_examples, load_examples, prepare, split_indices
from data_prep.regenerate import RegenResult, regenerate, regenerate_with_stats
from data_prep.render import Example, SkipRow, end_token_ids, render_example
from data_prep.sources import DataError, SourceStats, load_conversations
from data_prep.vocab import assistant_token_counts, draft_vocabulary

__all__ = [
    "PrepConfig", "PrepSummary", "prepare", "load_examples", "iter_examples", "split_indices",
    "regenerate", "regenerate_with_stats", "RegenResult",
    "Example", "SkipRow", "render_example", "end_token_ids",
    "DataError", "SourceStats", "load_conversations", "draft_vocabulary", "assistant_token_counts",
]
