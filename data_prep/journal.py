"""The replies a one-turn regeneration has written, kept on the disk as they are made, with the target features
generation computed: a stopped `eagle prep` (Ctrl-C, SIGKILL, a machine taken back) resumes with every reply a
complete shard holds, and the features never wait in memory for the end of the run.

    journal = Journal.open(out / "regenerated", key, width=H, dtype=torch.bfloat16)  # width 0: no features
    journal.done[i]              # a stopped run's reply i: JournalRow(prompt ids, reply ids, hit_eos)
    journal.add(i, prompt, reply)  # reply.features [P + N, H] go straight to the open shard's file
    journal.close()              # the open shard whole on the disk
    journal.feature_ref(i)       # (shard file, first token) of conversation i's features, for a split's store

The directory holds shards (`shard-GEN-NNNNN.safetensors`: `features` [tokens, H], the rows' features one after
the other; `ids`, their prompt and reply ids; `rows` [n, 4]: conversation index, prompt length, reply length,
whether the reply ended with an end token) and `index.json`, which names the complete shards and the settings they
were made with (`key`: the prep settings that decide a reply, and the target's identity). A shard closes every
`SHARD_BYTES` of features or `SHARD_SECONDS` of generation, whichever comes first, so a kill loses about a minute
of work at most. The index is rewritten whole after each shard is on the disk; a journal made with other settings
is started afresh under a new generation GEN (its index replaced, then its own old files removed, nothing else),
so a split's store made from the old one finds its shards gone instead of reading another journal's bytes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle.faults import fault
from eagle.features import (PREP_HINT, SHARD_BYTES, ShardFile, check_room, data_offset, next_shard_name, read_index,
                            write_index, write_whole)

SHARD_SECONDS = 60.0


@dataclass
class JournalRow:
    prompt: list[int]
    new_ids: list[int]
    hit_eos: bool


class Journal:
    """See the module docstring; `Journal.open` makes one over a folder."""

    def __init__(self, folder: Path, key: dict, width: int, dtype: torch.dtype, generation: str,
                 shards: list[dict], shard_bytes: int | None = None):
        self.folder, self.key, self.width, self.dtype = folder, key, width, dtype
        self.generation = generation  # in every shard's name: a store made for an earlier journal reads none of ours
        self.shards = shards
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self.done: dict[int, JournalRow] = {}  # the replies a stopped run wrote (taken, not generated again)
        self.refs: dict[int, tuple[str, int]] = {}  # every written reply: (shard file, its first token)
        self.open_shard: ShardFile | None = None
        self.open_rows: list[tuple[int, list[int], list[int], bool, int]] = []  # conv, prompt, reply, eos, token
        self.opened = 0.0

    @classmethod
    def open(cls, folder: str | Path, key: dict, width: int, dtype: torch.dtype, fresh: bool = False,
             shard_bytes: int | None = None) -> "Journal":
        """The journal in `folder`: its complete shards if it was made with this `key` (else, or with `fresh`, prep's
        overwrite, an empty one: its index is replaced first, then the old shards removed, so no index ever names
        a shard that is gone); the files a kill left that no index names are removed."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        index = read_index(folder)
        if index is not None and index.get("key") == key and not fresh:
            generation = index.get("generation", "")
            shards = [s for s in index["shards"] if data_offset(folder / s["file"]) is not None]
        else:
            if index is not None and not fresh:
                print(f"note: {folder} holds replies made with other settings or another target: starting afresh")
            generation, shards = os.urandom(4).hex(), []
        journal = cls(folder, key, width, dtype, generation, shards, shard_bytes)
        journal._write_index()
        named = {s["file"] for s in shards}
        for f in folder.iterdir():  # a shard a kill left before the index named it, or a stale journal's
            if f.name.startswith("shard-") and f.name not in named or f.name.startswith("index.json.tmp"):
                f.unlink()
        for s in shards:
            journal._read_shard(s["file"])
        return journal

    def _read_shard(self, name: str) -> None:
        from safetensors import safe_open

        with safe_open(self.folder / name, "pt") as f:
            ids, rows = f.get_tensor("ids").tolist(), f.get_tensor("rows").tolist()
        at = tok = 0
        for conv, p, n, eos in rows:
            self.done[conv] = JournalRow(ids[at: at + p], ids[at + p: at + p + n], bool(eos))
            self.refs[conv] = (name, tok)
            at += p + n
            tok += p + n if self.width else 0

    def expect(self, tokens: int, rows: int) -> None:
        """Say how much the features of `rows` more rows take at most (`tokens` tokens), and refuse in one line,
        before any is made, when the disk has not that much room (`eagle.features.check_room`)."""
        if not self.width:
            return
        size = tokens * self.width * self.dtype.itemsize
        print(f"target features of the regenerated rows: at most {size / 2**20:,.1f} MiB ({rows:,} replies to make, "
              f"{tokens:,} tokens with their prompts, {str(self.dtype).removeprefix('torch.')}), written to "
              f"{self.folder} as they are made")
        check_room(self.folder, size, "target features of the regenerated rows", PREP_HINT)

    def add(self, conv: int, prompt: list[int], new_ids: list[int], hit_eos: bool,
            features: torch.Tensor | None = None) -> None:
        """Conversation `conv`'s reply, and with a width its features [len(prompt) + len(new_ids), width]."""
        if self.width and (features is None or features.shape != (len(prompt) + len(new_ids), self.width)):
            got = None if features is None else tuple(features.shape)
            raise ValueError(f"journal row {conv}: features {got}, expected ({len(prompt) + len(new_ids)}, "
                             f"{self.width})")
        if self.open_shard is None:
            taken = {s["file"] for s in self.shards}
            self.open_shard = ShardFile(self.folder / next_shard_name(taken, f"shard-{self.generation}-"),
                                        self.width, self.dtype)
            self.opened = time.monotonic()
        at = self.open_shard.write(features) if self.width else 0
        self.open_rows.append((conv, list(prompt), list(new_ids), bool(hit_eos), at))
        if self.open_shard.nbytes >= self.shard_bytes or time.monotonic() - self.opened >= SHARD_SECONDS:
            self.close()

    def close(self) -> None:
        """The open shard whole on the disk, then the index naming it."""
        if self.open_shard is None:
            return
        rows = self.open_rows
        ids = torch.tensor([t for _, p, n, _, _ in rows for t in p + n], dtype=torch.int64)
        meta = torch.tensor([[c, len(p), len(n), int(e)] for c, p, n, e, _ in rows], dtype=torch.int64)
        self.open_shard.close({"ids": ids, "rows": meta})
        name = self.open_shard.path.name
        for conv, *_, at in rows:  # (their ids stay with the caller; the journal keeps where their features are)
            self.refs[conv] = (name, at)
        self.shards.append({"file": name, "rows": [c for c, *_ in rows]})
        self.open_shard, self.open_rows = None, []
        self._write_index()
        fault("journal-shard", len(self.shards))

    def abort(self) -> None:
        """Drop the open shard (an error on the way: its rows are made again next time)."""
        if self.open_shard is not None:
            self.open_shard.abort()
            self.open_shard, self.open_rows = None, []

    def feature_ref(self, conv: int) -> tuple[str, int]:
        """(shard file name, the token its features start at) of a written conversation."""
        return self.refs[conv]

    def write_store(self, folder: str | Path, convs: list[int], lengths: list[int]) -> None:
        """A feature store (eagle.features) of the conversations `convs`, in that order, of `lengths` tokens: an index
        naming where this journal wrote their features, no copy of them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.glob("shard-*"):  # an older store's own shards in the folder this index now takes
            f.unlink()
        shards: dict[str, dict] = {}
        for row, conv in enumerate(convs):
            name, at = self.refs[conv]
            s = shards.setdefault(name, {"file": os.path.relpath(self.folder / name, folder), "rows": [], "at": []})
            s["rows"].append(row)
            s["at"].append(at)
        write_index(folder, lengths, self.width, self.dtype, list(shards.values()))

    def _write_index(self) -> None:
        index = {"key": self.key, "generation": self.generation, "width": self.width, "dtype": str(self.dtype),
                 "shards": self.shards}
        write_whole(self.folder / "index.json", json.dumps(index).encode())
