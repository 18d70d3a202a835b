"""The target-feature store kept next to prepared rows: written in shards as the features are computed, read a row
at a time, so the features of a data set may be far larger than memory.

    store = features_dir(prepared, "train", target, layers, dtype)      # named by split, target identity, width
    with FeatureWriter(store, lengths, width, dtype) as w:              # resumes after the last complete shard
        for i in w.missing():                                           # the rows no shard holds yet
            w.add(i, feats_of_row_i)                                    # [T_i, width]
    feats = FeatureStore.open(store, lengths)                           # None unless complete, for these rows
    feats[i]                                                            # [T_i, width], read from its shard

A store is a directory of safetensors shards (`shard-NNNNN.safetensors`, about `SHARD_BYTES` each: the rows it
holds concatenated as one `features` tensor) and an `index.json` naming, for every shard, the rows it holds in
order. The index is rewritten (temp file, fsync, rename) after each shard is on the disk, so a killed pass resumes
from its last complete shard and a shard the index does not name is never read. A row is read by mapping just its
bytes of its shard (`numpy.memmap`) and copying them: memory holds the batch at hand, not the store. Features may
be kept in 16 bits (`dtype`, named in the directory): an EAGLE-3 head's (the last hidden state and three fused
layers) over 2M SmolLM2 tokens take 19 GB in float32, 9.6 GB in bfloat16.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 256 << 20
# safetensors' dtype names, and the numpy type whose bytes a row is read as (bfloat16: its 16 bits, viewed after)
_ST = {torch.float32: ("F32", np.float32), torch.bfloat16: ("BF16", np.int16), torch.float16: ("F16", np.float16)}


class FeatureError(ValueError):
    """A feature store that cannot be written here (no room on the disk, ...); the message says why in one line."""


def features_dir(prepared: str | Path, split: str, target, layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> Path:
    """`prepared/features-{split}-{target identity}-{hidden size}[-layers...][-dtype]/`: the identity hashes the
    target's tokenizer and weights (`TargetModel.identity`), so a fine-tune of the same base computes its own."""
    key = "" if not layers else "-layers" + "_".join(str(i) for i in layers)
    key += "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    return Path(prepared) / f"features-{split}-{target.identity}-{target.hidden_size}{key}"


def check_room(folder: Path, nbytes: int, what: str) -> None:
    """Refuse, in one line, to write `nbytes` into `folder` when its disk has not that much room (and 1 % more)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if nbytes * 1.01 > free:
        raise FeatureError(f"{what}: {nbytes / 2**30:,.2f} GiB do not fit in {str(folder)!r} ({free / 2**30:,.2f} GiB "
                           "free); free some room, keep the features in bfloat16 (data.feature_dtype), or compute "
                           "them per batch (data.online=true)")


def _write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # the rename itself on the disk, so an index never names a shard a power cut took back
        d = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(d)
    except OSError:
        pass
    finally:
        os.close(d)


def _read_index(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "index.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


class FeatureWriter:
    """Writes a store shard by shard; rows arrive in any order (`add`), each shard holds the rows in the order they
    came. Made over an existing index for the same rows, it keeps its complete shards (`missing` leaves their rows
    out) and drops files no index names."""

    def __init__(self, folder: Path, lengths: list[int], width: int, dtype: torch.dtype,
                 shard_bytes: int | None = None):
        self.folder, self.lengths, self.width, self.dtype = Path(folder), list(lengths), width, dtype
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self.folder.mkdir(parents=True, exist_ok=True)
        old = _read_index(self.folder)
        same = old is not None and old.get("lengths") == self.lengths and old.get("width") == width and \
            old.get("dtype") == str(dtype)
        # a named shard that is cut short or unreadable (a disk error, a copy that stopped) is written again
        self.shards: list[dict] = [s for s in old["shards"] if _data_offset(self.folder / s["file"]) is not None] \
            if same else []
        named = {s["file"] for s in self.shards}
        for f in self.folder.iterdir():  # a shard a killed pass left before its index named it, or a stale store's
            if f.name not in named and f.name != "index.json" and f.name.startswith(("shard-", "index.json.tmp")):
                f.unlink()
        self.done = {i for s in self.shards for i in s["rows"]}
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.pending_bytes = 0

    def missing(self) -> list[int]:
        return [i for i in range(len(self.lengths)) if i not in self.done]

    def add(self, row: int, feats: torch.Tensor) -> None:
        if feats.shape != (self.lengths[row], self.width):
            raise ValueError(f"feature row {row}: shape {tuple(feats.shape)}, expected "
                             f"({self.lengths[row]}, {self.width})")
        self.pending.append((row, feats.detach().to("cpu", self.dtype).contiguous()))
        self.pending_bytes += feats.numel() * self.dtype.itemsize
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """The pending rows as one shard on the disk, then the index naming it."""
        if not self.pending:
            return
        from safetensors.torch import save

        taken = {s["file"] for s in self.shards}  # (a shard dropped as unreadable leaves a gap in the numbers)
        name = next(f"shard-{n:05d}.safetensors" for n in range(len(taken) + 1)
                    if f"shard-{n:05d}.safetensors" not in taken)
        flat = torch.cat([f for _, f in self.pending])
        _write_whole(self.folder / name, save({"features": flat}))
        self.shards.append({"file": name, "rows": [i for i, _ in self.pending]})
        self.done.update(i for i, _ in self.pending)
        self.pending, self.pending_bytes = [], 0
        self._write_index()

    def _write_index(self) -> None:
        index = {"lengths": self.lengths, "width": self.width, "dtype": str(self.dtype), "shards": self.shards,
                 "complete": len(self.done) == len(self.lengths)}
        _write_whole(self.folder / "index.json", json.dumps(index).encode())

    def __enter__(self) -> "FeatureWriter":
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is None:
            self.flush()
            self._write_index()


class FeatureStore:
    """The rows of complete stores, read one at a time from their shards; `take(rows)` a view of some of them,
    `concat(stores)` the rows of several (prepared directories read together)."""

    def __init__(self, where: list[tuple[Path, int, int]], width: int, dtype: torch.dtype):
        self.where, self.width, self.dtype = where, width, dtype  # per row: (shard file, byte offset, tokens)

    @classmethod
    def open(cls, folder: str | Path, lengths: list[int]) -> "FeatureStore | None":
        """The store in `folder`, or None where there is none, it is not complete, or it was made for rows of other
        lengths (then its features are computed again)."""
        folder = Path(folder)
        index = _read_index(folder)
        if index is None or not index.get("complete") or index.get("lengths") != list(lengths):
            return None
        dtype = getattr(torch, index["dtype"].removeprefix("torch."))
        row_bytes = index["width"] * dtype.itemsize
        where: list = [None] * len(lengths)
        for shard in index["shards"]:
            path = folder / shard["file"]
            start = _data_offset(path)
            if start is None:
                print(f"note: feature shard {str(path)!r} is not a readable safetensors file; computing the features "
                      "again")
                return None
            for i in shard["rows"]:
                where[i] = (path, start, lengths[i])
                start += lengths[i] * row_bytes
        return cls(where, index["width"], dtype)

    @classmethod
    def concat(cls, stores: list["FeatureStore"]) -> "FeatureStore":
        return cls([w for s in stores for w in s.where], stores[0].width, stores[0].dtype)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> torch.Tensor:
        path, offset, n = self.where[i]
        view = np.memmap(path, dtype=_ST[self.dtype][1], mode="r", offset=offset, shape=(n, self.width))
        out = torch.from_numpy(np.array(view))  # a copy: the mapping goes with `view`
        del view
        return out.view(self.dtype) if self.dtype == torch.bfloat16 else out

    def take(self, rows: list[int]) -> "FeatureStore":
        return FeatureStore([self.where[i] for i in rows], self.width, self.dtype)


def _data_offset(path: Path) -> int | None:
    """Where the `features` tensor's bytes start in a shard (after safetensors' 8-byte length and JSON header), or
    None for a file that is not one or whose size is not the header's (cut short, or grown)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        start, end = header["features"]["data_offsets"]
        if os.path.getsize(path) != 8 + n + end:
            return None
        return 8 + n + start
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_features(folder: Path, feats: list[torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """A whole store of the rows `feats` (in memory already: prep's regeneration computed them)."""
    lengths = [f.shape[0] for f in feats]
    dtype = dtype or feats[0].dtype
    check_room(folder, sum(lengths) * feats[0].shape[1] * dtype.itemsize, f"features for {folder.name}")
    with FeatureWriter(folder, lengths, feats[0].shape[1], dtype) as w:
        for i in w.missing():
            w.add(i, feats[i])
