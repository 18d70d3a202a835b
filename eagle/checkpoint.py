"""Head checkpoints: a directory with `config.json` and `model.safetensors`, written whole or not at all. Heads in
the published EAGLE layouts load too (`eagle.interop`).

Every fix for older or foreign checkpoint layouts belongs in `_upgrade` so the rest of the code sees one format.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle.head import EagleHead, HeadConfig, make_head


class CheckpointError(ValueError):
    pass


def save_head(head: EagleHead, path, extra: dict | None = None) -> None:
    cfg = dataclasses.asdict(head.config)
    if extra:
        cfg["extra"] = extra
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state_dict().items()}
    write_head_dir(path, cfg, state)


def write_head_dir(path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors into a temporary sibling, then rename it into place (a directory
    already there is moved aside first and removed after)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    old = path.with_name(path.name + f".old{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _upgrade(cfg: dict) -> dict:
    """Bring older config layouts to the current one (none yet besides dropping bookkeeping keys)."""
    cfg = dict(cfg)
    cfg.pop("extra", None)
    return cfg


def _read_raw(path: Path) -> dict:
    f = path / "config.json"
    if not f.exists():
        raise CheckpointError(f"draft head {str(path)!r}: no config.json (is it a head directory?)")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"draft head {str(path)!r}: config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"draft head {str(path)!r}: config.json does not hold a mapping")
    return raw


def read_config(path, raw: dict | None = None) -> HeadConfig:
    """Our head config of directory `path` (`raw`: its config.json, when already read)."""
    path = Path(path)
    raw = _upgrade(_read_raw(path) if raw is None else raw)
    known = {fld.name for fld in dataclasses.fields(HeadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"draft head {str(path)!r}: unknown config keys {unknown}")
    return HeadConfig(**raw)


def validate_state(head: EagleHead, state: dict[str, torch.Tensor]) -> list[str]:
    """Every key that is missing, unexpected or of the wrong shape, one line each."""
    want = {k: v.shape for k, v in head.trainable_state_dict().items()}
    problems = [f"missing: {k} {tuple(s)}" for k, s in want.items() if k not in state]
    problems += [f"unexpected: {k} {tuple(v.shape)}" for k, v in state.items() if k not in want]
    problems += [f"wrong shape: {k} {tuple(v.shape)}, expected {tuple(want[k])}"
                 for k, v in state.items() if k in want and v.shape != want[k]]
    return problems


def load_head(path, device="cpu", dtype=torch.float32, target=None) -> EagleHead:
    """Our checkpoint directory, or one in a published EAGLE-1/2 or EAGLE-3 layout (`eagle.interop`; `target`
    gives an EAGLE-3 head without named feature layers the default ones)."""
    path = Path(path)
    from eagle.interop import is_published, read_published

    raw = _read_raw(path)
    if is_published(raw):
        cfg, state = read_published(path, raw, target)
    else:
        cfg = read_config(path, raw)
        weights = path / "model.safetensors"
        if not weights.exists():
            raise CheckpointError(f"draft head {str(path)!r}: no model.safetensors")
        state = load_file(str(weights))
    head = make_head(cfg)
    problems = validate_state(head, state)
    if problems:
        raise CheckpointError(f"draft head {str(path)!r} does not match its config: " + "; ".join(problems))
    head.load_state_dict(state, strict=False)
    return head.to(device=device, dtype=dtype).eval()  # .to(dtype) leaves the integer d2t buffer alone


def check_compatible(cfg: HeadConfig, target) -> None:
    """Refuse a head made for another target: hidden size, vocabulary and tokenizer must agree."""
    diffs = []
    if cfg.hidden_size != target.hidden_size:
        diffs.append(f"hidden size {cfg.hidden_size} vs {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        diffs.append(f"vocab size {cfg.vocab_size} vs {target.vocab_size}")
    if cfg.tokenizer_fingerprint and cfg.tokenizer_fingerprint != target.fingerprint:
        diffs.append(f"tokenizer fingerprint {cfg.tokenizer_fingerprint} vs {target.fingerprint}")
    if diffs:
        raise CheckpointError(
            f"draft head for target {cfg.target!r} does not fit target {target.name!r}: " + ", ".join(diffs))
