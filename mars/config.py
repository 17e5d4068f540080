"""params.yaml: loading, profiles and typed, validated sections.

``params.yaml`` holds every knob, grouped by stage. The top-level sections are the default (tiny)
profile. ``profile: NAME`` selects ``profiles.NAME``, a partial copy of the sections whose values win
over the top-level ones, so ``dvc exp run -S profile=smollm2`` switches everything at once and
``dvc exp run -S train.lr=1e-3`` changes one knob of the default profile.

Each concern owns one dataclass (``TrainConfig`` in the trainer, ``DecodeConfig`` in the decoder ...);
:func:`section` builds it from a section, checking every key and type and naming the key on error.
Semantic checks live in each dataclass's ``__post_init__`` and raise :class:`ConfigError`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from mars.errors import ConfigError

DEFAULT_PARAMS = Path("params.yaml")
T = TypeVar("T")


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def resolve(raw: dict, overrides: typing.Iterable[str] = (), source: str = "params.yaml") -> dict:
    """Apply ``key=value`` overrides (as ``dvc exp run -S`` would), then the selected profile."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = _parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:-1])} is not a section")
        node[path[-1]] = value
    profiles = raw.pop("profiles", {}) or {}
    name = raw.get("profile", "tiny")
    if name not in profiles and name != "tiny":
        known = ", ".join(sorted(set(profiles) | {"tiny"}))
        raise ConfigError(f"{source}: profile: unknown profile {name!r} (known: {known})")
    return _deep_merge(raw, profiles.get(name) or {})


def load_params(path: str | Path = DEFAULT_PARAMS, overrides: typing.Iterable[str] = ()) -> dict:
    """Read params.yaml, apply overrides and the profile; a missing or malformed file is a ConfigError."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file (run from the project root or pass --params)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return resolve(raw, overrides, source=str(path))


def _check(value: Any, hint: Any, key: str) -> Any:
    """Return ``value`` converted to ``hint`` where that is lossless (int -> float), else raise."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in get_args(hint):
            choices = " | ".join(map(str, get_args(hint)))
            raise ConfigError(f"{key}: expected one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in get_args(hint):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(value, arm, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {hint}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = get_args(hint)[:1] or (Any,)
        return [_check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        kt, vt = get_args(hint) or (Any, Any)
        return {_check(k, kt, key): _check(v, vt, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if hint is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML, and what `dvc exp run -S` writes) reads 3e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def build(cls: type[T], data: Any, key: str) -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types name ``key.field``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})")
    kwargs = {name: _check(value, hints[name], f"{key}.{name}") for name, value in data.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{key}: missing required key(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(key) else f"{key}.{msg}") from None


def section(params: dict, name: str, cls: type[T]) -> T:
    """The typed config of section ``name`` (dotted for nested, e.g. ``evaluate.gate``)."""
    node: Any = params
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return build(cls, node, name)


def as_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def add_params_arguments(parser: argparse.ArgumentParser) -> None:
    """The two options every stage verb takes to read its params."""
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one param, as `dvc exp run -S` does (repeatable)",
    )


def params_from_args(args: argparse.Namespace) -> dict:
    return load_params(args.params, args.overrides)


def cli(argv: list[str], verb: str = "params") -> int:
    parser = argparse.ArgumentParser(prog=f"mars {verb}", description="Print params.yaml as the stages see it.")
    add_params_arguments(parser)
    parser.add_argument("--section", help="print one section only")
    args = parser.parse_args(argv)
    params = params_from_args(args)
    if args.section:
        params = {args.section: params.get(args.section)}
    print(json.dumps(params, indent=2, sort_keys=False))
    return 0
