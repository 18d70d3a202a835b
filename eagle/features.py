"""The target-feature files kept next to prepared rows, so a feature pass over the same rows runs once.

    path = features_path(prepared_dir, "train", target)          # named by split, target identity and hidden size
    save_features(path, feats)                                   # list of [T_i, D] tensors, one per row
    feats = load_features(path, lengths)                         # None unless the file matches those row lengths

Prep writes them when regeneration computed the features already; training writes them after its own pass.
Features may be kept in 16 bits (`dtype`, named in the file name): an EAGLE-3 head's (the last hidden state and
three fused layers) over 2M SmolLM2 tokens take 19 GB in float32, 9.6 GB in bfloat16. Rows that are consecutive
views of one flat tensor (`flat_rows`) are written without a copy. A file is written whole (temp file + rename) and
trusted only if its row lengths match (an unreadable one is computed again).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = ("float32", "bfloat16", "float16")


def features_path(prepared: str | Path, split: str, target, layers: list[int] | None = None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """`prepared/features-{split}-{target identity}-{hidden size}[-layers...][-dtype].safetensors`: the identity
    hashes the target's tokenizer and weights (`TargetModel.identity`), so a fine-tune of the same base computes
    its own."""
    key = "" if not layers else "-layers" + "_".join(str(i) for i in layers)
    key += "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    return Path(prepared) / f"features-{split}-{target.identity}-{target.hidden_size}{key}.safetensors"


def flat_rows(lengths: list[int], dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialised [T_i, dim] rows, consecutive views of one flat tensor (filled in place, saved without a copy)."""
    return list(torch.empty(sum(lengths), dim, dtype=dtype).split(lengths))


def _flat(feats: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor `feats` are consecutive views of (as `flat_rows` makes them), else their concatenation."""
    first, n = feats[0], sum(f.shape[0] for f in feats)
    storage, offset = first.untyped_storage(), first.storage_offset()
    whole = first.new_empty(0).set_(storage, offset, (n, first.shape[1]))
    for f in feats:
        if (f.untyped_storage().data_ptr() != storage.data_ptr() or f.storage_offset() != offset
                or not f.is_contiguous()):
            return torch.cat(feats).contiguous()
        offset += f.numel()
    return whole


def save_features(path: Path, feats: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    lengths = torch.tensor([f.shape[0] for f in feats])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({"features": _flat(feats), "lengths": lengths}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # on the disk before the rename makes it the file
    os.replace(tmp, path)


def load_features(path: Path, lengths: list[int], dtype: torch.dtype | None = None) -> list[torch.Tensor] | None:
    """The rows of a feature file (converted to `dtype` if given), or None when it is missing or was made for rows
    of other lengths."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        data = load_file(str(path))
    except SafetensorError as e:
        print(f"note: feature cache {str(path)!r} is not a readable safetensors file ({str(e).splitlines()[0]}); "
              "computing the features again")
        return None
    if set(data) != {"features", "lengths"} or not torch.equal(data["lengths"], torch.tensor(lengths)):
        return None
    flat = data["features"] if dtype is None else data["features"].to(dtype)
    return list(torch.split(flat, lengths))
