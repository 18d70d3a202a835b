"""The replies a one-turn regeneration has written, kept on the disk as they are made, with the target features
generation computed: a stopped `eagle prep` (Ctrl-C, SIGKILL, a machine taken back) resumes with every reply a
complete shard holds, and the features never wait in memory for the end of the run.

    journal = Journal(out / "regenerated", key, width=H, dtype=torch.bfloat16)  # width 0: replies without features
    journal.done[i]              # conversation i's JournalRow (prompt ids, reply ids, hit_eos), if written
    journal.add(i, prompt, reply)  # reply.features [P + N, H] go straight to the open shard's file
    journal.close()              # the open shard whole on the disk
    journal.feature_ref(i)       # (shard file, first token) of conversation i's features, for a split's store

The directory holds shards (`shard-NNNNN.safetensors`: `features` [tokens, H], the rows' features one after the
other; `ids`, their prompt and reply ids; `rows` [n, 4]: conversation index, prompt length, reply length, whether
the reply ended with an end token) and `index.json`, which names the complete shards and the settings they were
made with (`key`: the prep settings that decide a reply, and the target's identity). A shard closes every
`SHARD_BYTES` of features or `SHARD_SECONDS` of generation, whichever comes first, so a kill loses about a minute
of work at most. The index is rewritten whole after each shard is on the disk; a journal made with other settings
is started afresh (its own files removed, nothing else).
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
    def __init__(self, folder: str | Path, key: dict, width: int, dtype: torch.dtype, fresh: bool = False,
                 shard_bytes: int | None = None):
        """`fresh`: start afresh whatever the folder holds (prep's `overwrite`)."""
        self.folder, self.key, self.width, self.dtype = Path(folder), key, width, dtype
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self.folder.mkdir(parents=True, exist_ok=True)
        index = None if fresh else read_index(self.folder)
        self.shards: list[dict] = []
        if index is not None and index.get("key") == key:
            self.shards = [s for s in index["shards"] if data_offset(self.folder / s["file"]) is not None]
        elif index is not None:
            print(f"note: {self.folder} holds replies made with other settings or another target: starting afresh")
        named = {s["file"] for s in self.shards}
        for f in self.folder.iterdir():  # a shard a kill left before the index named it, or a stale journal's
            if f.name not in named and f.name.startswith(("shard-", "index.json")):
                f.unlink()
        self.done: dict[int, JournalRow] = {}
        self.refs: dict[int, tuple[str, int]] = {}
        for s in self.shards:
            self._read_shard(s["file"])
        self.open: ShardFile | None = None
        self.open_rows: list[tuple[int, list[int], list[int], bool, int]] = []  # conv, prompt, reply, eos, first token
        self.opened = 0.0
        if self.shards:
            self._write_index()

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
        if self.open is None:
            taken = {s["file"] for s in self.shards}
            self.open = ShardFile(self.folder / next_shard_name(taken), self.width, self.dtype)
            self.opened = time.monotonic()
        at = self.open.write(features) if self.width else 0
        self.open_rows.append((conv, list(prompt), list(new_ids), bool(hit_eos), at))
        if self.open.nbytes >= self.shard_bytes or time.monotonic() - self.opened >= SHARD_SECONDS:
            self.close()

    def close(self) -> None:
        """The open shard whole on the disk, then the index naming it."""
        if self.open is None:
            return
        rows = self.open_rows
        ids = torch.tensor([t for _, p, n, _, _ in rows for t in p + n], dtype=torch.int64)
        meta = torch.tensor([[c, len(p), len(n), int(e)] for c, p, n, e, _ in rows], dtype=torch.int64)
        self.open.close({"ids": ids, "rows": meta})
        name = self.open.path.name
        for conv, p, n, eos, at in rows:
            self.done[conv] = JournalRow(p, n, eos)
            self.refs[conv] = (name, at)
        self.shards.append({"file": name, "rows": [c for c, *_ in rows]})
        self.open, self.open_rows = None, []
        self._write_index()
        fault("journal-shard", len(self.shards))

    def abort(self) -> None:
        """Drop the open shard (an error on the way: its rows are made again next time)."""
        if self.open is not None:
            self.open.abort()
            self.open, self.open_rows = None, []

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
        index = {"key": self.key, "width": self.width, "dtype": str(self.dtype), "shards": self.shards}
        write_whole(self.folder / "index.json", json.dumps(index).encode())
