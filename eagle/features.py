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
order. Rows go to their shard's file as they come (`ShardFile`: memory holds one row, not a shard); the index is
rewritten (temp file, fsync, rename) after each shard is whole on the disk, so a killed pass resumes from its last
complete shard and a shard the index does not name is never read. An index may also name rows of shards elsewhere
with the token each starts at (`write_index`): a split of `eagle prep`'s rows reads its features where
regeneration wrote them (data_prep/journal.py), without a copy. A row is read by mapping just its
bytes of its shard (`numpy.memmap`) and copying them: memory holds the batch at hand, not the store. Features may
be kept in 16 bits (`dtype`, named in the directory): an EAGLE-3 head's (the last hidden state and three fused
layers) over 2M SmolLM2 tokens take 19 GB in float32, 9.6 GB in bfloat16.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 256 << 20
HEADER_ROOM = 504  # header bytes a streamed shard keeps at its start (with the length's 8: rows start at byte 512)
# safetensors' dtype names, and the numpy type whose bytes a row is read as (bfloat16: its 16 bits, viewed after)
_ST = {torch.float32: ("F32", np.float32), torch.bfloat16: ("BF16", np.int16), torch.float16: ("F16", np.float16)}
_ST_EXTRA = {torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def default_dtype(target_dtype: torch.dtype) -> torch.dtype:
    """The dtype a target's features are stored in unless asked otherwise: the target's own (bfloat16 for a bfloat16
    target: half the disk of float32, and nothing lost), float32 for any other (float64 test targets)."""
    return target_dtype if target_dtype in _ST else torch.float32


class FeatureError(ValueError):
    """A feature store that cannot be written here (no room on the disk, ...); the message says why in one line."""


def features_dir(prepared: str | Path, split: str, target, layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> Path:
    """`prepared/features-{split}-{target identity}-{hidden size}[-layers...][-dtype]/`: the identity hashes the
    target's tokenizer and weights (`TargetModel.identity`), so a fine-tune of the same base computes its own."""
    key = "" if not layers else "-layers" + "_".join(str(i) for i in layers)
    key += "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    return Path(prepared) / f"features-{split}-{target.identity}-{target.hidden_size}{key}"


TRAINING_HINT = "keep the features in bfloat16 (data.feature_dtype), or compute them per batch (data.online=true)"
PREP_HINT = "keep them in bfloat16 (--feature-dtype bfloat16), or leave them to training (--no-save-features)"


def check_room(folder: Path, nbytes: int, what: str, hint: str = TRAINING_HINT) -> None:
    """Refuse, in one line, to write `nbytes` into `folder` when its disk has not that much room (and 1 % more)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if nbytes * 1.01 > free:
        raise FeatureError(f"{what}: {nbytes / 2**30:,.2f} GiB do not fit in {str(folder)!r} ({free / 2**30:,.2f} GiB "
                           f"free); free some room, {hint}")


def write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """A rename in `folder` on the disk, so an index never names a shard a power cut took back."""
    try:
        d = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(d)
    except OSError:
        pass
    finally:
        os.close(d)


def read_index(folder: Path, name: str = "index.json") -> dict | None:
    try:
        return json.loads((Path(folder) / name).read_text())
    except (OSError, json.JSONDecodeError):
        return None


class ShardFile:
    """One safetensors shard written as its rows arrive: each row's bytes go to a temporary file at once, after room
    for the header, which `close` writes when the sizes are known (safetensors lets a header end in spaces); the
    file takes its name only then, so memory holds one row at a time and a shard is on the disk whole or not at
    all. Besides `features` [tokens, width], `close` may append small tensors (a journal's ids)."""

    def __init__(self, path: Path, width: int, dtype: torch.dtype):
        self.path, self.width, self.dtype = Path(path), width, dtype
        self.tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.file.write(b" " * (8 + HEADER_ROOM))
        self.tokens = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * self.width * self.dtype.itemsize

    def write(self, feats: torch.Tensor) -> int:
        """Append rows [n, width]; returns the token they start at."""
        at = self.tokens
        flat = feats.detach().to("cpu", self.dtype).contiguous()
        self.file.write(flat.view(torch.uint8).numpy())  # (bfloat16 has no numpy type; its bytes do)
        self.tokens += flat.shape[0]
        return at

    def close(self, extra: dict[str, torch.Tensor] | None = None) -> None:
        """The extra tensors after the rows, the header in its room, the file flushed and renamed into place."""
        header, end = {"features": {"dtype": _ST[self.dtype][0], "shape": [self.tokens, self.width],
                                    "data_offsets": [0, self.nbytes]}}, self.nbytes
        for name, t in (extra or {}).items():
            t = t.detach().cpu().contiguous()
            self.file.write(t.view(torch.uint8).numpy())
            header[name] = {"dtype": _ST_EXTRA[t.dtype], "shape": list(t.shape),
                            "data_offsets": [end, end + t.numel() * t.element_size()]}
            end += t.numel() * t.element_size()
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > HEADER_ROOM:
            self.abort()
            raise FeatureError(f"shard {str(self.path)!r}: a header of {len(text)} bytes does not fit its room "
                               f"({HEADER_ROOM})")
        self.file.seek(0)
        self.file.write(HEADER_ROOM.to_bytes(8, "little") + text.ljust(HEADER_ROOM))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the unfinished shard."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class FeatureWriter:
    """Writes a store shard by shard; rows arrive in any order (`add`), each shard holds the rows in the order they
    came, streamed to the disk as they come (`ShardFile`). Made over an existing store for the same rows, it keeps
    its complete shards (`missing` leaves their rows out) and drops its files no index names. Leaving the `with`
    block by an exception drops the unfinished shard (its rows are computed again next time).

    With `part` (this process's number in a pass several share) it writes its own shards (`shard-pN-*`) and index
    (`index-pN.json`), leaves the other parts' files alone, and counts the rows any index in the folder holds as
    done; `join_parts` then writes the one `index.json` of them all."""

    def __init__(self, folder: Path, lengths: list[int], width: int, dtype: torch.dtype,
                 shard_bytes: int | None = None, part: int | None = None):
        self.folder, self.lengths, self.width, self.dtype = Path(folder), list(lengths), width, dtype
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self.index_name = "index.json" if part is None else f"index-p{part}.json"
        self.prefix = "shard-" if part is None else f"shard-p{part}-"
        self.folder.mkdir(parents=True, exist_ok=True)
        # a named shard that is cut short or unreadable (a disk error, a copy that stopped) is written again
        found = {name: self._usable(name) for name in _index_names(self.folder)}
        self.shards: list[dict] = found.get(self.index_name, [])
        named = {s["file"] for shards in found.values() for s in shards}
        for f in self.folder.iterdir():  # a shard a killed pass left before an index named it, or a stale store's
            stale_index = part is None and f.name.startswith("index-p") and not found.get(f.name)
            if (f.name.startswith(self.prefix) and f.name not in named) or stale_index or \
                    f.name.startswith(self.index_name + ".tmp"):
                f.unlink()
        self.done = {i for shards in found.values() for s in shards for i in s["rows"]}
        self.open: ShardFile | None = None
        self.open_rows: list[int] = []

    def _usable(self, index_name: str) -> list[dict]:
        """The readable shards of an index in the folder made for these rows, width and dtype (else none)."""
        return usable_shards(self.folder, index_name, self.lengths, self.width, self.dtype)

    def missing(self) -> list[int]:
        return [i for i in range(len(self.lengths)) if i not in self.done]

    def add(self, row: int, feats: torch.Tensor) -> None:
        if feats.shape != (self.lengths[row], self.width):
            raise ValueError(f"feature row {row}: shape {tuple(feats.shape)}, expected "
                             f"({self.lengths[row]}, {self.width})")
        if self.open is None:
            taken = {s["file"] for s in self.shards} | {f.name for f in self.folder.glob(self.prefix + "*")}
            self.open = ShardFile(self.folder / next_shard_name(taken, self.prefix), self.width, self.dtype)
        self.open.write(feats)
        self.open_rows.append(row)
        if self.open.nbytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """The open shard whole on the disk, then the index naming it."""
        if self.open is None:
            return
        self.open.close()
        self.shards.append({"file": self.open.path.name, "rows": self.open_rows})
        self.done.update(self.open_rows)
        self.open, self.open_rows = None, []
        self._write_index()

    def _write_index(self) -> None:
        write_index(self.folder, self.lengths, self.width, self.dtype, self.shards, self.index_name)

    def __enter__(self) -> "FeatureWriter":
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is None:
            self.flush()
            self._write_index()
        elif self.open is not None:
            self.open.abort()
            self.open, self.open_rows = None, []


def _index_names(folder: Path) -> list[str]:
    """The store's own index and the indexes of a shared pass's parts, in that order."""
    parts = sorted(f.name for f in folder.glob("index-p*.json"))
    return (["index.json"] if (folder / "index.json").exists() else []) + parts


def usable_shards(folder: Path, index_name: str, lengths: list[int], width: int, dtype: torch.dtype) -> list[dict]:
    """The readable shards `folder/index_name` names, if it was made for rows of these `lengths`, `width` and
    `dtype`; else none."""
    index = read_index(folder, index_name)
    if index is None or index.get("lengths") != list(lengths) or index.get("width") != width or \
            index.get("dtype") != str(dtype):
        return []
    return [s for s in index["shards"] if data_offset(folder / s["file"]) is not None]


def join_parts(folder: Path, lengths: list[int], width: int, dtype: torch.dtype) -> None:
    """One `index.json` naming the shards of every part of a shared pass (and of the index already there), each
    shard once; the parts' own indexes are removed once it is written."""
    folder = Path(folder)
    shards, seen = [], set()
    for name in _index_names(folder):
        for s in usable_shards(folder, name, lengths, width, dtype):
            if s["file"] not in seen:
                seen.add(s["file"])
                shards.append(s)
    write_index(folder, lengths, width, dtype, shards)
    for f in folder.glob("index-p*.json"):
        f.unlink()


def next_shard_name(taken: set[str], prefix: str = "shard-") -> str:
    """The first `{prefix}NNNNN.safetensors` not in `taken` (a shard dropped as unreadable leaves a gap)."""
    return next(f"{prefix}{n:05d}.safetensors" for n in range(len(taken) + 1)
                if f"{prefix}{n:05d}.safetensors" not in taken)


def write_index(folder: Path, lengths: list[int], width: int, dtype: torch.dtype, shards: list[dict],
                name: str = "index.json") -> None:
    """A store's index, written whole: `shards` name their files (relative to `folder`, which may lead out of it:
    a split's store can point into prep's journal) and the rows they hold, in order; with `at`, the token each of
    those rows starts at in its file (a shard shared with other stores), else the rows follow each other."""
    done = {i for s in shards for i in s["rows"]}
    index = {"lengths": list(lengths), "width": width, "dtype": str(dtype), "shards": shards,
             "complete": len(done) == len(lengths)}
    write_whole(Path(folder) / name, json.dumps(index).encode())


class FeatureStore:
    """The rows of complete stores, read one at a time from their shards; `take(rows)` a view of some of them,
    `concat(stores)` the rows of several (prepared directories read together, each in its own dtype)."""

    def __init__(self, where: list[tuple[Path, int, int, torch.dtype]], width: int):
        self.where, self.width = where, width  # per row: (shard file, byte offset, tokens, dtype)

    @classmethod
    def open(cls, folder: str | Path, lengths: list[int]) -> "FeatureStore | None":
        """The store in `folder`, or None where there is none, it is not complete, or it was made for rows of other
        lengths (then its features are computed again)."""
        folder = Path(folder)
        index = read_index(folder)
        if index is None or not index.get("complete") or index.get("lengths") != list(lengths):
            return None
        dtype = getattr(torch, index["dtype"].removeprefix("torch."))
        row_bytes = index["width"] * dtype.itemsize
        where: list = [None] * len(lengths)
        for shard in index["shards"]:
            path = folder / shard["file"]
            layout = shard_layout(path)
            firsts = shard.get("at") or list(itertools.accumulate((lengths[k] for k in shard["rows"]), initial=0))
            if layout is None or layout[1:3] != (index["width"], _ST[dtype][0]) or any(
                    a + lengths[i] > layout[3] for a, i in zip(firsts, shard["rows"])):
                print(f"note: feature shard {str(path)!r} is missing, not a readable safetensors file, or not the one "
                      "its index was made for; computing the features again")
                return None
            for a, i in zip(firsts, shard["rows"]):
                where[i] = (path, layout[0] + a * row_bytes, lengths[i], dtype)
        return cls(where, index["width"])

    @classmethod
    def concat(cls, stores: list["FeatureStore"]) -> "FeatureStore":
        widths = {s.width for s in stores}
        if len(widths) > 1:
            raise FeatureError(f"feature stores of widths {sorted(widths)} cannot be read together")
        return cls([w for s in stores for w in s.where], stores[0].width)

    @property
    def dtype(self) -> torch.dtype | None:
        """The rows' dtype on the disk (None when stores of several dtypes are read together)."""
        kinds = {w[3] for w in self.where}
        return kinds.pop() if len(kinds) == 1 else None

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> torch.Tensor:
        path, offset, n, dtype = self.where[i]
        view = np.memmap(path, dtype=_ST[dtype][1], mode="r", offset=offset, shape=(n, self.width))
        out = torch.from_numpy(np.array(view))  # a copy: the mapping goes with `view`
        del view
        return out.view(dtype) if dtype == torch.bfloat16 else out

    def take(self, rows: list[int]) -> "FeatureStore":
        return FeatureStore([self.where[i] for i in rows], self.width)


def shard_layout(path: Path) -> tuple[int, int, str, int] | None:
    """(where the `features` tensor's bytes start, its width, its safetensors dtype, its rows) in a shard, or None for
    a file that is not one or whose size is not the header's (cut short, or grown)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
        if os.path.getsize(path) != 8 + n + end:
            return None
        feats = header["features"]
        rows, width = feats["shape"]
        return 8 + n + feats["data_offsets"][0], width, feats["dtype"], rows
    except (OSError, ValueError, KeyError, TypeError):
        return None


def data_offset(path: Path) -> int | None:
    """Where the `features` tensor's bytes start in a shard, or None (`shard_layout`)."""
    layout = shard_layout(path)
    return None if layout is None else layout[0]


def write_features(folder: Path, feats: list[torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """A whole store of the rows `feats`, held in memory already (small stores: tests, tools)."""
    lengths = [f.shape[0] for f in feats]
    dtype = dtype or feats[0].dtype
    check_room(folder, sum(lengths) * feats[0].shape[1] * dtype.itemsize, f"features for {folder.name}")
    with FeatureWriter(folder, lengths, feats[0].shape[1], dtype) as w:
        for i in w.missing():
            w.add(i, feats[i])
