"""params.yaml: loading, profiles and typed, validated sections.

``params.yaml`` holds every knob, grouped by stage. The top-level sections are the default (tiny)
profile. ``profile: NAME`` selects ``profiles.NAME``, a partial copy of the sections whose values win
over the top-level ones, so ``dvc exp run -S profile=smollm2`` switches everything at once and
``dvc exp run -S train.lr=1e-3`` changes one knob of the default profile.

Each concern owns one dataclass (``TrainConfig`` in the trainer, ``DecodeConfig`` in the decoder ...)
whose defaults are the top-level values of params.yaml (tests/test_config.py holds them equal).
:func:`build` validates a section into it with pydantic, strictly (no bool for a number, no string
for an integer), and names the dotted key on error. Semantic checks live in each dataclass's
``__post_init__`` and raise :class:`ConfigError` with a message that starts with the field's name.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mars.errors import ConfigError

DEFAULT_PARAMS = Path("params.yaml")
T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML (YAML 1.1) reads ``3e-3``, as ``dvc exp run -S`` writes it, as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)


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
    # `+key=value` adds a key params.yaml lacks, `++key=value` adds or replaces: dvc exp run -S's (Hydra's) syntax
    return key.strip().removeprefix("++").removeprefix("+").split("."), load_yaml(raw)


def _shadowed(path: list[str], given, resolved) -> list[str] | None:
    """The first leaf of an override ``given`` at ``path`` that the resolved params do not hold."""
    if isinstance(given, dict) and isinstance(resolved, dict):
        for key, value in given.items():
            hit = _shadowed([*path, key], value, resolved.get(key))
            if hit is not None:
                return hit
        return None
    same = given == resolved or (isinstance(given, float) and isinstance(resolved, float)
                                 and math.isnan(given) and math.isnan(resolved))  # a .nan override: checked later
    return None if same else path


def resolve(raw: dict, overrides: typing.Iterable[str] = (), source: str = "params.yaml") -> dict:
    """Apply ``key=value`` overrides (as ``dvc exp run -S`` would), then the selected profile. An override of a
    key the profile also sets would be silently replaced by the profile's value: that is an error naming the
    profile's key to override instead."""
    raw = copy.deepcopy(raw)
    given = []
    for text in overrides:
        path, value = _parse_override(text)
        given.append((text, path, value))
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
    resolved = _deep_merge(raw, profiles.get(name) or {})
    for text, path, value in given:
        if path[0] in ("profile", "profiles"):
            continue
        node = resolved
        for part in path[:-1]:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        hit = _shadowed(path, value, node.get(path[-1]) if isinstance(node, dict) else None)
        if hit is not None:
            key = ".".join(hit)
            raise ConfigError(f"override {text!r}: the profile {name} sets {key}, and its value wins; override "
                              f"profiles.{name}.{key} instead")
    return resolved


def load_params(path: str | Path = DEFAULT_PARAMS, overrides: typing.Iterable[str] = ()) -> dict:
    """Read params.yaml, apply overrides and the profile; a missing or malformed file is a ConfigError."""
    path = Path(path)
    try:
        raw = load_yaml(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file (run from the project root or pass --params)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return resolve(raw, overrides, source=str(path))


# pydantic error type -> what the key should have held
_EXPECTED = {
    "int_type": "an integer", "float_type": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "string_type": "a string",
    "list_type": "a list", "dict_type": "a mapping", "dataclass_type": "a mapping", "dataclass_exact_type": "a mapping",
}


@functools.cache
def _schema(cls: Any):
    from pydantic import ConfigDict, create_model

    # The config reaches nested stdlib dataclasses too, so the library's classes need no pydantic.
    # No float param may be inf or nan (`-S train.lr=.inf` trains to NaN at step 2).
    return create_model(f"Section_{getattr(cls, '__name__', 'value')}",
                        __config__=ConfigDict(extra="forbid", allow_inf_nan=False), value=(cls, ...))


def _field_type(hint: Any, loc: tuple) -> Any:
    """The type at ``loc`` inside ``hint`` (dataclass fields by name; list items and dict values by key)."""
    for part in loc:
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(arm for arm in typing.get_args(hint) if arm is not type(None))
        if dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part, Any)
        else:
            hint = (typing.get_args(hint) or (Any,))[-1]
    return hint


def _describe(error: dict, cls: Any, key: str) -> str:
    loc = error["loc"][1:]  # drop the wrapper's "value"
    where = key + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    kind = error["type"]
    if kind == "value_error":  # a __post_init__ check: its message starts with the field, relative to where
        return f"{where}.{error['ctx']['error']}"
    if kind == "unexpected_keyword_argument":
        parent, name = where.rsplit(".", 1)
        known = ", ".join(f.name for f in dataclasses.fields(_field_type(cls, loc[:-1])) if f.init)
        return f"{parent}: unknown key {name!r} (known: {known})"
    if kind in ("missing_argument", "missing"):
        return f"{where}: missing required key"
    if kind == "literal_error":
        return f"{where}: expected {error['ctx']['expected']}, got {error['input']!r}"
    if kind in _EXPECTED:
        return f"{where}: expected {_EXPECTED[kind]}, got {error['input']!r}"
    return f"{where}: {error['msg']}, got {error['input']!r}"


def build(cls: type[T], data: Any, key: str) -> T:
    """``data`` (a section of params) as ``cls``; unknown keys, wrong types and failed checks name the key.

    ``cls`` is a dataclass (a missing section gives its defaults) or a plain type such as ``int``.
    """
    from pydantic import ValidationError

    if data is None and dataclasses.is_dataclass(cls):
        data = {}
    try:
        # Strict JSON mode: mappings become dataclasses, and no value changes type on the way.
        return _schema(cls).model_validate_json(json.dumps({"value": data}, default=str), strict=True).value
    except ValidationError as err:
        raise ConfigError("; ".join(_describe(e, cls, key) for e in err.errors())) from None


def section(params: dict, name: str, cls: type[T]) -> T:
    """The typed config of section ``name`` (dotted for nested, e.g. ``evaluate.gate``)."""
    node: Any = params
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return build(cls, node, name)
