"""Typed configuration: dataclasses loaded from JSON/TOML files and ``key=value`` overrides.

Every section is a dataclass whose ``__post_init__`` validates its own values, so a bad value
fails with a message naming the key before any work starts. Unknown keys are errors, not
silently ignored, because a misspelt key would otherwise run a different experiment.

A setting with a fixed set of values is typed ``Literal[...]``: :func:`from_dict` checks it
from the type, and the section's ``__post_init__`` calls :func:`check_literal` so that direct
construction is checked too. A setting whose values a registry holds (plugins may add to it)
stays a ``str`` checked against that registry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from .errors import UserError, read_text, require_file

T = TypeVar("T")


class ConfigError(UserError):
    """A configuration file or override that cannot be used."""


def check_choice(
    value: Any, allowed: typing.Iterable[Any], key: str, error: type[UserError] = ConfigError
) -> None:
    """Raise ``error`` naming ``key`` and the ``allowed`` values unless ``value`` is one of them.

    The one wording of every enum-like setting: ``attribution.mode: unknown 'x'; allowed:
    paper, hardened``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise error(f"{key}: unknown {value!r}; allowed: {', '.join(map(str, allowed))}")


@functools.cache
def literal_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field name -> allowed values of every ``Literal``-typed field of dataclass ``cls``."""
    # get_type_hints, not field.type: under ``from __future__ import annotations`` that is a str.
    hints = typing.get_type_hints(cls)
    return {
        f.name: typing.get_args(hints[f.name])
        for f in dataclasses.fields(cls)
        if typing.get_origin(hints[f.name]) is Literal
    }


def check_literal(obj: Any, section: str, error: type[UserError] = ConfigError) -> None:
    """Check every ``Literal``-typed field of dataclass ``obj`` (call it in ``__post_init__``).

    ``section`` is the dotted path of ``obj``'s section (``attribution``, ``model.tiny``), so
    that the error names the setting as a configuration file or ``--set`` spells it; ``error``
    is the section's own :class:`UserError` subclass."""
    for name, allowed in literal_fields(type(obj)).items():
        check_choice(getattr(obj, name), allowed, f"{section}.{name}", error)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        check_choice(value, typing.get_args(hint), key)
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        return from_dict(hint, value, prefix=f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(
            f"unknown setting {prefix}{unknown[0]}; allowed in this section: "
            f"{', '.join(prefix + f for f in sorted(fields))}"
        )
    data = dict(data)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        # A nested section starts from the parent's default for it (which may differ from the
        # section class's own defaults), so that setting one key keeps the others.
        if (
            f.name in data
            and isinstance(data[f.name], dict)
            and dataclasses.is_dataclass(hints[f.name])
            and f.default_factory is not dataclasses.MISSING
        ):
            data[f.name] = _deep_merge(to_dict(f.default_factory()), data[f.name])
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def check_client_ids(ids: list[int], K: int, key: str) -> None:
    """Raise :class:`ConfigError` unless ``ids`` are distinct client ids in ``0..K-1``."""
    if any(not 0 <= c < K for c in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"{key}: ids must be distinct and in 0..{K - 1}, got {ids}")


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a config dataclass (for writing the resolved config)."""
    return dataclasses.asdict(obj)


def parse_scalar(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, booleans, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as JSON, else taken as strings)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. attribution.M=5")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is a value, not a section")
        node[parts[-1]] = parse_scalar(raw.strip())
    return out


def read_file(path: str | Path, option: str = "--config") -> dict[str, Any]:
    """Read a ``.json`` or ``.toml`` configuration file (given as ``option``) into a dict."""
    p = require_file(path, option, "a .json or .toml configuration file", error=ConfigError)
    try:
        if p.suffix == ".json":
            data = json.loads(read_text(p, option, ConfigError))
        elif p.suffix == ".toml":
            data = tomllib.loads(read_text(p, option, ConfigError))
        else:
            raise ConfigError(f"config file {str(p)!r}: use a .json or .toml file")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of settings")
    return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults of ``cls``, updated by the file at ``path`` and then by ``overrides``."""
    data = read_file(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides or []))
