"""The target-feature files kept next to prepared rows, so a feature pass over the same rows runs once.

    path = features_path(prepared_dir, "train", target)          # named by split, tokenizer and hidden size
    save_features(path, feats)                                   # list of [T_i, D] tensors, one per row
    feats = load_features(path, lengths)                         # None unless the file matches those row lengths

Prep writes them when regeneration already computed the features; training writes them after its own pass.
A file is written whole (temp file + rename) and trusted only if its row lengths match the rows.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def features_path(prepared: str | Path, split: str, target, layers: list[int] | None = None) -> Path:
    """`prepared/features-{split}-{tokenizer fingerprint}-{hidden size}[-layers...].safetensors`."""
    key = "" if not layers else "-layers" + "_".join(str(i) for i in layers)
    return Path(prepared) / f"features-{split}-{target.fingerprint}-{target.hidden_size}{key}.safetensors"


def save_features(path: Path, feats: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    lengths = torch.tensor([f.shape[0] for f in feats])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({"features": torch.cat(feats).contiguous(), "lengths": lengths}, str(tmp))
    os.replace(tmp, path)


def load_features(path: Path, lengths: list[int]) -> list[torch.Tensor] | None:
    """The rows of a feature file, or None when it is missing or was made for rows of other lengths."""
    from safetensors.torch import load_file

    if not path.exists():
        return None
    data = load_file(str(path))
    if not torch.equal(data["lengths"], torch.tensor(lengths)):
        return None
    return list(torch.split(data["features"], lengths))
