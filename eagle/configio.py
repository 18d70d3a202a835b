"""Typed configs: a (nested) dataclass is the schema; YAML files and dotted `key=value` overrides go through it.

    cfg = load_config(TrainConfig, "configs/smollm2-135m-eagle1.yaml", ["optim.lr=1e-4", "budget.minutes=5"])

Unknown keys are rejected with the full dotted name; values are coerced to the field's type. Defaults live only
in the dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


def _coerce(value, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {where!r} must be a mapping, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (typing.Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, inner, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config key {where!r} must be true or false, got {value!r}")
    if tp in (int, float, str):
        try:
            if tp is int and isinstance(value, str):
                return int(float(value)) if "e" in value.lower() else int(value)
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key {where!r} must be {tp.__name__}, got {value!r}") from None
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r} (known: {', '.join(sorted(names))})")
    return cls(**{k: _coerce(v, hints[k], prefix + k) for k, v in data.items()})


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value) if value else ""
    return data


def load_config(cls, path: str | Path | None = None, overrides: list[str] = ()):
    data = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return from_dict(cls, apply_overrides(data, list(overrides)))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
