"""Head checkpoints: a directory with `config.json` and `model.safetensors`, written whole or not at all. This
module reads and writes the files; `eagle.head.load_head` (`EagleHead.from_pretrained`) builds the head from them,
or from a head in a published EAGLE layout (`eagle.interop`).

Every fix for older or foreign checkpoint layouts belongs in `_upgrade` so the rest of the code sees one format.

Writing a directory (a head here, a training checkpoint in `train.loop`) never leaves a moment without a complete
copy on disk, whenever the process is killed: the new one is written beside it and flushed (fsync), the old one is
renamed to `NAME.prev`, the new one to `NAME`, and only then is `NAME.prev` removed (`replace_dir`); a kill between
the two renames leaves `NAME.prev`, which `recover_dir` puts back. Writing a head replaces or removes nothing but a
head's own files: a directory that holds anything else is refused with one line (`check_head_dir`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle.configio import ConfigError, from_dict
from eagle.head_config import HeadConfig

HEAD_FILES = ("config.json", "model.safetensors")  # all that a head directory holds, ours and the exported layouts


class CheckpointError(ValueError):
    pass


# -- writing directories whole ------------------------------------------------------------------------------------
def fsync_path(path) -> None:
    """Flush a file, or a directory's entries (POSIX only: elsewhere directories cannot be opened), to the disk."""
    path = Path(path)
    if os.name != "posix" and path.is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prev_dir(final) -> Path:
    """Where `replace_dir` keeps the previous copy of `final` until the new one is in place."""
    final = Path(final)
    return final.with_name(final.name + ".prev")


def replace_dir(new, final, remove=shutil.rmtree, between=None) -> None:
    """Rename the complete, flushed directory `new` to `final` so that a complete copy exists at every instant: a
    `final` already there is renamed to `final.prev` first and removed (with `remove`) only once `new` is in place.
    `between` (tests' fault injection) is called between the two renames."""
    new, final = Path(new), Path(final)
    prev, parent = prev_dir(final), final.parent
    if final.exists():
        if prev.exists():  # left by an earlier kill after both renames; `final` is complete
            remove(prev)
        os.replace(final, prev)
        fsync_path(parent)
    # else a `final.prev` left by a kill between the renames is the last complete copy: it stays until `new` is in
    if between is not None:
        between()
    os.replace(new, final)
    fsync_path(parent)
    if prev.exists():
        remove(prev)


def recover_dir(final) -> Path | None:
    """`final` once a kill between `replace_dir`'s renames is undone (its `final.prev` renamed back), or None when
    there is neither."""
    final, prev = Path(final), prev_dir(final)
    if not final.exists() and prev.exists():
        os.replace(prev, final)
        fsync_path(final.parent)
    return final if final.exists() else None


def _weight_names(file: Path) -> set[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError):
        return set()


def head_dir_problem(path) -> str | None:
    """Why `path` must not be replaced by a head, or None: it does not exist, is an empty directory, or holds only a
    head's files (a config.json of ours or of a published layout, model.safetensors)."""
    path = Path(path)
    if path.is_symlink():
        return "it is a symbolic link; name the directory itself"
    if not path.exists():
        return None
    if not path.is_dir():
        return "it is a file"
    names = sorted(p.name for p in path.iterdir())
    other = [n for n in names if n not in HEAD_FILES or not (path / n).is_file()]
    if other:
        return f"it holds {', '.join(other[:3])}" + (f" and {len(other) - 3} more" if len(other) > 3 else "")
    if not names:
        return None
    if "config.json" not in names:
        return "it has model.safetensors but no config.json"
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "its config.json is not valid JSON"
    if isinstance(raw, dict) and ("head_type" in raw or "LlamaForCausalLMEagle3" in (raw.get("architectures") or [])
                                  or "fc.weight" in _weight_names(path / "model.safetensors")):
        return None
    return "its config.json and weights are not a draft head's"


def check_head_dir(path, what: str = "") -> None:
    """Refuse, with one line naming it (after `what`, e.g. "out "), a `path` that a head may not replace
    (`head_dir_problem`), or whose `path.prev` (where the old head goes while the new one is renamed in) is not a
    head's either."""
    for p in (Path(path), prev_dir(path)):
        problem = head_dir_problem(p)
        if problem:
            raise CheckpointError(f"{what}{str(p)!r} exists and is not a head directory ({problem}): nothing was "
                                  "written; name a new directory for the head")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # POSIX: signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmps(path: Path) -> None:
    """Temporary siblings `NAME.tmpPID` of `path` left by a writer that was killed (its process is gone), when they
    hold nothing but a head's files."""
    if os.name != "posix":  # os.kill(pid, 0) is no question elsewhere
        return
    for p in path.parent.glob(glob.escape(path.name) + ".tmp*"):
        pid = p.name[len(path.name) + len(".tmp"):]
        if (pid.isdigit() and int(pid) != os.getpid() and p.is_dir() and not p.is_symlink()
                and all(f.name in HEAD_FILES and f.is_file() for f in p.iterdir()) and not _alive(int(pid))):
            _remove_head_dir(p)


def _remove_head_dir(path: Path) -> None:
    """Remove a head directory by its own files only (rmdir fails if anything else appeared in it)."""
    for name in HEAD_FILES:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


def save_head(head, path, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """A head's config (with `extra`, bookkeeping a reader drops) and its own weights into directory `path`, the
    floating-point ones in `dtype` (None: as they are; the d2t / t2d maps stay integers)."""
    cfg = dataclasses.asdict(head.config)
    if extra:
        cfg["extra"] = extra
    state = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.trainable_state_dict().items()}
    write_head_dir(path, cfg, state)


def write_head_dir(path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors into a temporary sibling, flush it, and rename it into place
    (`replace_dir`: a head already there is kept as `path.prev` until the new one is in). A `path` that holds
    anything but a head is refused before anything is written (`check_head_dir`)."""
    path = Path(path)
    check_head_dir(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _remove_stale_tmps(path)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in (*(tmp / name for name in HEAD_FILES), tmp):
        fsync_path(f)
    replace_dir(tmp, path, remove=_remove_head_dir)


def read_weights(path: Path, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """The tensors of `path/file`; a file that is not a whole safetensors file is a one-line CheckpointError."""
    try:
        return load_file(str(path / file))
    except SafetensorError as e:
        raise CheckpointError(f"draft head {str(path)!r}: {file} is not a readable safetensors file "
                              f"({str(e).splitlines()[0]})") from None


# -- reading ------------------------------------------------------------------------------------------------------
def _upgrade(cfg: dict) -> dict:
    """Bring older config layouts to the current one (none yet besides dropping bookkeeping keys)."""
    cfg = dict(cfg)
    cfg.pop("extra", None)
    return cfg


def read_raw(path: Path) -> dict:
    """The config.json of head directory `path`, as a mapping; a one-line CheckpointError where there is none."""
    if not path.exists():
        prev = prev_dir(path)
        raise CheckpointError(f"draft head {str(path)!r}: no config.json (no such directory" + (
            f"; an interrupted write left the previous head in {str(prev)!r})" if prev.exists() else ")"))
    if not path.is_dir():
        raise CheckpointError(f"draft head {str(path)!r} is a file; name the head's directory")
    f = path / "config.json"
    if not f.exists():
        raise CheckpointError(f"draft head {str(path)!r}: no config.json (is it a head directory?)")
    try:
        raw = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"draft head {str(path)!r}: config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"draft head {str(path)!r}: config.json does not hold a mapping")
    return raw


def read_config(path, raw: dict | None = None) -> HeadConfig:
    """Our head config of directory `path` (`raw`: its config.json, when already read)."""
    path = Path(path)
    raw = _upgrade(read_raw(path) if raw is None else raw)
    known = {fld.name for fld in dataclasses.fields(HeadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"draft head {str(path)!r}: unknown config keys {unknown}")
    try:
        cfg = from_dict(HeadConfig, raw)  # each value checked against its field's type
    except ConfigError as e:
        raise CheckpointError(f"draft head {str(path)!r}: config.json: {e}") from None
    sizes = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size")
    if cfg.head_type not in ("eagle1", "eagle3"):
        raise CheckpointError(f"draft head {str(path)!r}: config.json: head_type {cfg.head_type!r} is not eagle1 or "
                              "eagle3")
    bad = [f"{k} {getattr(cfg, k)}" for k in sizes if getattr(cfg, k) < 1]
    if bad:
        raise CheckpointError(f"draft head {str(path)!r}: config.json: {', '.join(bad)} (sizes must be positive)")
    return cfg
