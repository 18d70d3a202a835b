"""Turn a conversation source into tokenized training rows for a draft head: the whole data step in one call.

    from data_prep.prep import PrepConfig, prepare
    summary = prepare(PrepConfig(target="smollm2-135m", data="sharegpt", out="runs/data", max_rows=300))
    print(summary.format())

Steps: read and normalize conversations (sources.py), optionally rewrite the replies with the target
(regenerate.py), render each with the target's chat template and mask the assistant tokens (render.py), split
off a validation set, and write into `out/`. A row regenerated in one turn is not re-rendered: it is the prompt
ids plus the reply ids exactly as the target read and wrote them, and the features generation computed are
kept with it.

    train.jsonl, val.jsonl        one {"input_ids": [...], "loss_mask": [...]} per line
    val_conversations.jsonl       the messages of each validation row ({"messages": [...]}), for evaluation prompts
    regenerated/                  one-turn replies and their target features as they were made (data_prep.journal)
    features-{split}-*/           the target features of each split's rows: an index into regenerated/ (eagle.features)
    summary.json                  counts: rows read, kept, dropped by reason, tokens, masked fraction
    prep_config.yaml              the resolved PrepConfig

Every file is written under a temporary name and renamed, so a killed run never leaves a half-written file. A
one-turn regeneration writes each reply to `regenerated/` as it is made (features in the target's dtype by
default, bfloat16 for a bfloat16 target): host memory holds one batch of features, and a stopped run (even by
SIGKILL) resumes with the replies already written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from data_prep.journal import Journal
from data_prep.regenerate import prompt_ids, regenerate_with_stats, user_turns
from data_prep.render import Example, SkipRow, check_chat_template, render_example
from data_prep.sources import DataError, first_turns, load_conversations
from eagle.configio import save_config
from eagle.device import resolve_dtype
from eagle.features import DTYPES as FEATURE_DTYPES, PREP_HINT, check_room, default_dtype, features_dir


@dataclass
class PrepConfig:
    target: str                    # alias, .gguf, local dir or hub id (eagle.target.load_target)
    data: str                      # "sharegpt", a .json/.jsonl/.parquet file, or a hub dataset name
    out: str                       # output directory
    max_rows: int | None = None    # rows read from `data` (kept + dropped); None reads all
    skip_rows: int = 0             # rows of `data` passed over first, e.g. the ones an earlier shard used
    regenerate: bool = False       # rewrite the assistant replies with the target's greedy replies
    max_new_tokens: int = 256      # per regenerated reply
    regen_batch_size: int = 32
    # Regeneration starts no new batch that would end after this many minutes at the previous batch's pace (0: no
    # limit); the rows it did not reach are dropped as time_budget. The rows are then as many as the machine can
    # write in that time, taken from the front of the data (sorted by length within chunks of
    # regenerate.DEADLINE_CHUNK batches).
    max_minutes: float = 0.0
    max_length: int = 2048         # rows longer than this (in tokens) are dropped as too_long, never cut
    val_fraction: float = 0.05
    seed: int = 0                  # for the train / validation split
    max_turns: int | None = None   # keep the first N assistant turns of each conversation; None keeps all
    overwrite: bool = False        # redo the work even when `out` already holds rows made with this same config
    # With regenerate and max_turns 1: keep the target features generation computed anyway (features-*, about
    # 2.3 kB per token for SmolLM2 in float32), so training skips its own pass over the rows.
    save_features: bool = True
    # their dtype on the disk: auto (the target's: bfloat16 for a bfloat16 target), float32, bfloat16, float16
    feature_dtype: str = "auto"
    device: str = "auto"           # where the target regenerates and computes features: auto, cpu, cuda, cuda:N
    dtype: str = "auto"            # the target's precision: auto (bfloat16 on CUDA, float32 elsewhere), float32, ...


@dataclass
class PrepSummary:
    rows_read: int
    kept: int
    dropped: dict[str, int]        # reason -> rows (source and render reasons together)
    train_rows: int
    val_rows: int
    tokens: int
    assistant_tokens: int
    masked_fraction: float         # assistant_tokens / tokens
    seconds: float
    source_note: str = ""          # e.g. the truncated tail of the embedded ShareGPT file
    trimmed: dict[str, int] = field(default_factory=dict)  # reason -> rows kept but shortened
    regenerated_replies: int = 0
    out: str = ""
    rows_skipped: int = 0          # rows passed over before reading (skip_rows)

    def format(self) -> str:
        def reasons(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v:,}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "none"

        lines = [f"rows skipped {self.rows_skipped:,} (skip_rows)"] if self.rows_skipped else []
        lines += [
            f"rows read {self.rows_read:,}: kept {self.kept:,}, dropped {sum(self.dropped.values()):,} "
            f"({reasons(self.dropped)})",
            f"trimmed rows: {reasons(self.trimmed)}",
            f"split: train {self.train_rows:,}, validation {self.val_rows:,}",
            f"tokens {self.tokens:,}, assistant (masked) {self.assistant_tokens:,} ({self.masked_fraction:.1%})",
        ]
        if self.regenerated_replies:
            lines.append(f"regenerated replies: {self.regenerated_replies:,}")
        if self.source_note:
            lines.append(f"note: {self.source_note}")
        lines.append(f"wrote {self.out} in {self.seconds:.1f}s")
        return "\n".join(lines)


def _write_atomic(path: Path, write) -> None:
    """Call write(file) on a temporary sibling of `path`, then rename it into place."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        write(f)
    os.replace(tmp, path)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    def write(f):
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    _write_atomic(path, write)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) index lists, each in ascending order; at least one val row when n >= 2."""
    n_val = 0 if n < 2 else min(n - 1, max(1, round(n * val_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def drop_repeats(convs: list[list[dict]], max_turns: int | None, regenerate: bool) -> tuple[list[list[dict]], int]:
    """The conversations without repeats of an earlier one (ShareGPT holds many), compared on what becomes the row:
    the turns `max_turns` keeps, and with `regenerate` only their prompts (the target would write the same replies
    again). A repeat would also put the same row on both sides of the train / validation split."""
    seen, kept = set(), []
    for msgs in convs:
        key = json.dumps([(m["role"], "" if regenerate and m["role"] == "assistant" else m["content"])
                          for m in first_turns(msgs, max_turns)], default=str)
        if key not in seen:
            seen.add(key)
            kept.append(msgs)
    return kept, len(convs) - len(kept)


def _check_config(cfg: PrepConfig) -> None:
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {cfg.val_fraction}")
    if cfg.max_length <= 0 or (cfg.max_rows is not None and cfg.max_rows <= 0):
        raise DataError(f"max_length and max_rows must be positive, got {cfg.max_length} and {cfg.max_rows}")
    if cfg.max_turns is not None and cfg.max_turns <= 0:
        raise DataError(f"max_turns must be positive or None, got {cfg.max_turns}")
    if cfg.max_minutes < 0 or (cfg.max_minutes and not cfg.regenerate):
        raise DataError(f"max_minutes {cfg.max_minutes}: bounds regeneration, so it needs regenerate=true and a "
                        f"value >= 0")
    if cfg.feature_dtype not in ("auto", *FEATURE_DTYPES):
        raise DataError(f"feature_dtype {cfg.feature_dtype!r}: expected auto or one of {', '.join(FEATURE_DTYPES)}")
    if cfg.regenerate and cfg.max_length <= cfg.max_new_tokens:
        raise DataError(f"max_length {cfg.max_length} leaves no room for a prompt with "
                        f"max_new_tokens {cfg.max_new_tokens}")
    out = Path(cfg.out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)  # the nearest part of the path there is
    if blocker is not None and not blocker.is_dir():
        raise DataError(f"out {cfg.out!r}: {str(blocker)!r} is a file, not a directory")


def prepare(cfg: PrepConfig, target=None) -> PrepSummary:
    """Run the data step described in the module docstring; `target` (a TargetModel) is loaded if not given."""
    t0 = time.perf_counter()
    _check_config(cfg)  # before the slow parts
    done = _finished(cfg)
    if done is not None:
        return done
    from eagle.target import load_target, target_config

    if target is None:  # the tokenizer and config first: the checks below need no weights
        config, tok = target_config(cfg.target)
    else:
        tok = target.tokenizer
    check_chat_template(tok)  # fail before reading any data

    convs, src = load_conversations(cfg.data, cfg.max_rows, allow_no_assistant=cfg.regenerate,
                                    skip_rows=cfg.skip_rows)
    dropped, trimmed = Counter(src.dropped), Counter(src.trimmed)
    convs, repeats = drop_repeats(convs, cfg.max_turns, cfg.regenerate)
    if repeats:
        dropped["duplicate"] += repeats
    replies = 0
    ended = [None] * len(convs)
    one_turn = cfg.regenerate and cfg.max_turns == 1  # rows are then the generated ids themselves
    single = [None] * len(convs)  # with one_turn: (prompt ids, Reply) per row
    out = Path(cfg.out)
    if one_turn and cfg.save_features:  # refuse, before the target loads, features the disk cannot hold
        hidden = config.get_text_config(decoder=True).hidden_size if target is None else target.hidden_size
        check_feature_room(cfg, convs, tok, hidden)
    if target is None:
        target = load_target(cfg.target, cfg.device, cfg.dtype)
    journal = open_journal(cfg, target) if one_turn else None
    if cfg.regenerate:
        # A prompt longer than this cannot give a row that surely fits in max_length.
        max_prompt = cfg.max_length - cfg.max_new_tokens
        regen = regenerate_with_stats(target, convs, cfg.max_new_tokens, cfg.regen_batch_size, max_prompt,
                                      cfg.max_turns, max_seconds=cfg.max_minutes * 60 if cfg.max_minutes else None,
                                      journal=journal)
        replies, convs, ended = regen.replies, regen.conversations, regen.ended
        if regen.resumed:
            print(f"took {regen.resumed:,} replies from {journal.folder} (a stopped run's), generated "
                  f"{replies - regen.resumed:,}")
        if one_turn:
            single = regen.last_turn
    else:
        convs = [first_turns(c, cfg.max_turns) for c in convs]

    examples, kept_convs, conv_of = [], [], []
    for c, (msgs, why, turn) in enumerate(zip(tqdm(convs, desc="render", unit="row"), ended, single)):
        if not any(m["role"] == "assistant" for m in msgs):
            dropped[why or "no_assistant"] += 1  # regeneration ended it before its first reply
            continue
        if why is not None:
            trimmed[why] += 1  # regeneration ended it after some replies: the row keeps those
        if turn is not None:  # the row is exactly what the target read and wrote: prompt ids + reply ids
            prompt, reply = turn
            examples.append(Example(input_ids=prompt + reply.new_ids,
                                    loss_mask=[0] * len(prompt) + [1] * len(reply.new_ids)))
        else:
            try:
                examples.append(render_example(tok, msgs, cfg.max_length, end_ids=target.eos_ids))
            except SkipRow as e:
                dropped[e.reason] += 1
                continue
        kept_convs.append(msgs)
        conv_of.append(c)
    if not examples:
        hint = "; prompt-only rows (turns) need regenerate=true" if dropped["no_assistant"] else ""
        raise DataError(f"data {cfg.data!r}: no usable rows out of {src.rows_read:,} read "
                        f"(dropped: {dict(dropped)}){hint}")

    train_idx, val_idx = split_indices(len(examples), cfg.val_fraction, cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", [dataclasses.asdict(examples[i]) for i in train_idx])
    _write_jsonl(out / "val.jsonl", [dataclasses.asdict(examples[i]) for i in val_idx])
    _write_jsonl(out / "val_conversations.jsonl", [{"messages": kept_convs[i]} for i in val_idx])
    if journal is not None and journal.width:  # every kept row came with its features, in the journal
        for split, idx in (("train", train_idx), ("val", val_idx)):
            journal.write_store(features_dir(out, split, target, dtype=journal.dtype), [conv_of[i] for i in idx],
                                [len(examples[i].input_ids) for i in idx])

    tokens = sum(len(ex.input_ids) for ex in examples)
    masked = sum(sum(ex.loss_mask) for ex in examples)
    summary = PrepSummary(
        rows_read=src.rows_read, rows_skipped=src.rows_skipped, kept=len(examples),
        dropped=dict(sorted(dropped.items())),
        train_rows=len(train_idx), val_rows=len(val_idx), tokens=tokens, assistant_tokens=masked,
        masked_fraction=masked / tokens, seconds=0.0, source_note=src.note,
        trimmed=dict(sorted(trimmed.items())),
        regenerated_replies=replies, out=str(out),
    )
    tmp = out / f"prep_config.yaml.tmp{os.getpid()}"
    save_config(cfg, tmp)
    os.replace(tmp, out / "prep_config.yaml")
    summary.seconds = time.perf_counter() - t0
    _write_atomic(out / "summary.json", lambda f: json.dump(dataclasses.asdict(summary), f, indent=2))
    return summary


def feature_dtype(cfg: PrepConfig, target_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype prep stores features in: `feature_dtype`, or (auto) the target's (`dtype`, as loaded)."""
    if cfg.feature_dtype != "auto":
        return getattr(torch, cfg.feature_dtype)
    return default_dtype(target_dtype or resolve_dtype(cfg.dtype, cfg.device))


def check_feature_room(cfg: PrepConfig, convs: list[list[dict]], tokenizer, hidden: int) -> None:
    """Refuse, in one line naming the bytes needed and free, a one-turn regeneration whose features the disk of
    `out` cannot hold (beside what its journal holds already). Every row is at most `max_length` tokens, so that
    bound is tried first; only when it does not fit are the prompts rendered and counted (`planned_rows`)."""
    width = hidden * feature_dtype(cfg).itemsize
    # a stopped run's journal holds some already: resumed, they need no more room; started afresh, theirs is freed
    journal = Path(cfg.out) / "regenerated"
    held = sum(f.stat().st_size for f in journal.glob("shard-*")) if journal.is_dir() else 0
    if len(convs) * cfg.max_length * width * 1.01 <= shutil.disk_usage(nearest_dir(Path(cfg.out))).free + held:
        return
    _, rows = planned_rows(cfg, tokenizer, convs)
    check_room(Path(cfg.out), max(0, sum(rows) * width - held), "target features of the regenerated rows", PREP_HINT)


def nearest_dir(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def planned_rows(cfg: PrepConfig, tokenizer, convs: list[list[dict]] | None = None) -> tuple[list[int], list[int]]:
    """(prompt tokens, row tokens at most) of each row `prepare(cfg)` would make, read, de-duplicated and rendered as
    it does, without the target: with regeneration each reply counts `max_new_tokens` (replies that end sooner make
    the rows shorter) and its prompt is the conversation so far (the user turns alone: the replies are not written
    yet); without, the rendered row itself. `convs`: the conversations, read and de-duplicated already. For `eagle
    plan` and prep's own check of the disk."""
    _check_config(cfg)
    if convs is None:
        convs, _ = load_conversations(cfg.data, cfg.max_rows, allow_no_assistant=cfg.regenerate,
                                      skip_rows=cfg.skip_rows)
        convs, _ = drop_repeats(convs, cfg.max_turns, cfg.regenerate)
    prompts, rows = [], []
    for msgs in tqdm(convs, desc="count", unit="row"):
        try:
            if cfg.regenerate:
                head, users = user_turns(msgs)
                users = users[: cfg.max_turns] if cfg.max_turns else users
                if not users:
                    continue
                first = prompt_ids(tokenizer, head + users[:1], cfg.max_length - cfg.max_new_tokens)
                whole = prompt_ids(tokenizer, head + users, 1 << 30) if len(users) > 1 else first
                prompts.append(len(first))
                rows.append(len(whole) + len(users) * cfg.max_new_tokens)
            else:
                n = len(render_example(tokenizer, first_turns(msgs, cfg.max_turns), cfg.max_length).input_ids)
                prompts.append(0)
                rows.append(n)
        except SkipRow:
            continue
    return prompts, rows


def open_journal(cfg: PrepConfig, target) -> Journal:
    """`out/regenerated`, the journal of a one-turn regeneration: the replies (and features) a stopped run with the
    same settings and target wrote are taken from it; with `overwrite`, or other settings, it starts afresh."""
    dtype = feature_dtype(cfg, target.dtype)
    decides = ("data", "max_rows", "skip_rows", "max_new_tokens", "max_length", "max_turns", "save_features")
    key = {"target": target.identity, "feature_dtype": str(dtype), **{k: getattr(cfg, k) for k in decides}}
    return Journal.open(Path(cfg.out) / "regenerated", key, target.hidden_size if cfg.save_features else 0, dtype,
                        fresh=cfg.overwrite)


def _finished(cfg: PrepConfig) -> PrepSummary | None:
    """The summary of an earlier run into the same `out` with the same settings, so reruns reuse its rows."""
    out = Path(cfg.out)
    if cfg.overwrite or not (out / "summary.json").exists() or not (out / "prep_config.yaml").exists():
        return None

    # where it ran does not name the data; a setting an earlier version did not write had its default then; a
    # dtype is compared as what it resolves to here ("auto" was written as float32 before it existed)
    ignored = ("overwrite", "device")
    same = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ignored}
    written = yaml.safe_load((out / "prep_config.yaml").read_text()) or {}
    defaults = {f.name: f.default for f in dataclasses.fields(PrepConfig) if f.default is not dataclasses.MISSING}
    old = {k: v for k, v in {**defaults, **written}.items() if k not in ignored}
    for d in (same, old):
        d["dtype"] = str(resolve_dtype(d["dtype"], cfg.device))
    if old != same:
        return None
    print(f"reusing the rows in {out} (prepared earlier with the same settings; --overwrite redoes them)")
    return PrepSummary(**json.loads((out / "summary.json").read_text()))


def load_examples(path: str | Path) -> list[Example]:
    """Read a train.jsonl / val.jsonl written by `prepare` back into Examples."""
    return list(iter_examples(path))


def iter_examples(path: str | Path):
    """The Examples of a train.jsonl / val.jsonl, one at a time (a reader keeps what it needs of each, not a list of
    them all: Python lists of ints take ~36 bytes a token)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"examples file {str(path)!r} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ex = Example(input_ids=row["input_ids"], loss_mask=row["loss_mask"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}:{lineno}: not an {{input_ids, loss_mask}} row") from None
            if len(ex.input_ids) != len(ex.loss_mask):
                raise DataError(f"{path}:{lineno}: input_ids and loss_mask differ in length")
            yield ex
