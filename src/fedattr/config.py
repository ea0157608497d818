"""Typed configuration: dataclasses loaded from JSON/TOML files and ``key=value`` overrides.

Every section is a dataclass whose ``__post_init__`` validates its own values, so a bad value
fails with a message naming the key before any work starts. Unknown keys are errors, not
silently ignored, because a misspelt key would otherwise run a different experiment.

A setting with a fixed set of values is typed ``Literal[...]``: :func:`from_dict` checks it
from the type, and the section's ``__post_init__`` calls :func:`check_literal` so that direct
construction is checked too. A setting whose values a registry holds (plugins may add to it)
stays a ``str`` checked against that registry.

A setting that moved keeps its old name as an alias: a section lists them in its ``ALIASES``
class attribute (old key -> its new dotted path within the section, e.g. ``"N":
"protocol.N"``). :func:`from_dict` resolves them before anything is validated, so errors name
the new key, and says once per key on standard error which key the old name now is (one line,
``fedattr: note: ...``); a saved configuration (a run folder's ``config.json``) is read with
``quiet=True``, without that note. :func:`load` resolves the aliases of a file and of every
``--set`` key before the overrides are applied, so that an old name given on the command line
overrides the file's new one (and the other way round).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import sys
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
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

    The one wording of every enum-like setting: ``attribution.protocol.mode: unknown 'x'; allowed:
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


# --- old names (aliases) -----------------------------------------------------------------------


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("fedattr_config_quiet", default=False)
_NOTED: set[str] = set()
"""Old keys already noted in this process (each is noted once)."""


def aliases_of(cls: Any) -> Mapping[str, str]:
    """Old key -> new dotted path (within the section) of dataclass ``cls``: its ``ALIASES``."""
    return getattr(cls, "ALIASES", None) or {}


@contextlib.contextmanager
def quiet_aliases(quiet: bool = True) -> Iterator[None]:
    """Within it, old names are resolved without the deprecation note (a saved configuration:
    a run written before the rename is not the user's mistake)."""
    token = _QUIET.set(_QUIET.get() or quiet)
    try:
        yield
    finally:
        _QUIET.reset(token)


def note_alias(old: str, new: str) -> None:
    """One line on standard error, once per old key, naming the new key (unless quiet)."""
    if _QUIET.get() or old in _NOTED:
        return
    _NOTED.add(old)
    print(f"fedattr: note: {old} is now {new}; the old name is deprecated", file=sys.stderr)


def _section_type(cls: Any, name: str) -> Any:
    """The dataclass type of ``cls``'s field ``name`` when it is a section, else ``None``."""
    if not dataclasses.is_dataclass(cls):
        return None
    hint = typing.get_type_hints(cls).get(name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def resolve_aliases(cls: Any, data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``data`` (a table of section ``cls``) with every old key of this level moved to its new
    place (noted once); ``data`` is not changed. An old key and its new one both given with
    different values is an error naming both."""
    aliases = aliases_of(cls)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    moved = [k for k in data if k in aliases and k not in names]
    if not moved:
        return dict(data)
    out = {k: v for k, v in data.items() if k not in moved}
    for old in moved:
        new = aliases[old]
        note_alias(prefix + old, prefix + new)
        *path, leaf = new.split(".")
        node = out
        for i, part in enumerate(path):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                where = prefix + ".".join(path[: i + 1])
                raise ConfigError(f"{where}: expected a table of settings, got {child!r}")
            node[part] = child = dict(child)
            node = child
        if leaf in node and node[leaf] != data[old]:
            raise ConfigError(
                f"{prefix}{old} and {prefix}{new}: both given, with different values "
                f"({prefix}{old} is the old name of {prefix}{new}); give {prefix}{new} only"
            )
        node[leaf] = data[old]
    return out


def canonical(cls: Any, data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``data`` with the old keys of every section of ``cls`` (nested ones too) resolved."""
    out = resolve_aliases(cls, data, prefix)
    for key, value in out.items():
        sub = _section_type(cls, key)
        if sub is not None and isinstance(value, dict):
            out[key] = canonical(sub, value, f"{prefix}{key}.")
    return out


def canonical_key(cls: Any, key: str) -> str:
    """A dotted key (``attribution.N``) as its section tree spells it now
    (``attribution.protocol.N``), noted once where it was an old name."""
    out: list[str] = []
    node = cls
    for part in key.split("."):
        if node is None:
            out.append(part)
            continue
        names = {f.name for f in dataclasses.fields(node)}
        aliases = aliases_of(node)
        steps = [part]
        if part not in names and part in aliases:
            steps = aliases[part].split(".")
            note_alias(".".join([*out, part]), ".".join([*out, *steps]))
        for step in steps:
            out.append(step)
            node = _section_type(node, step) if node is not None else None
    return ".".join(out)


def _canonical_override(cls: Any, item: str) -> str:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        return item  # apply_overrides names the mistake
    return f"{canonical_key(cls, key.strip())}={raw}"


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
        return _from_dict(hint, value, f"{key}.")
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


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "", *, quiet: bool = False) -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are errors.

    Old key names (the sections' ``ALIASES``) are resolved first, each noted once on standard
    error unless ``quiet`` (a saved configuration)."""
    with quiet_aliases(quiet):
        return _from_dict(cls, data, prefix)


def _from_dict(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    data = resolve_aliases(cls, data, prefix)
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
        # Its old keys are resolved first, so that they do not meet the defaults' new ones.
        if (
            f.name in data
            and isinstance(data[f.name], dict)
            and dataclasses.is_dataclass(hints[f.name])
            and f.default_factory is not dataclasses.MISSING
        ):
            own = resolve_aliases(hints[f.name], data[f.name], f"{prefix}{f.name}.")
            data[f.name] = deep_merge(to_dict(f.default_factory()), own)
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``update``'s keys over it, tables merged key by key (neither changed)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def check_client_ids(ids: list[int], K: int, key: str) -> None:
    """Raise :class:`ConfigError` unless ``ids`` are distinct client ids in ``0..K-1``."""
    if any(not 0 <= c < K for c in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"{key}: ids must be distinct and in 0..{K - 1}, got {ids}")


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a config dataclass (for writing the resolved config)."""
    return dataclasses.asdict(obj)


def flat_keys(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A configuration's leaves by dotted key (``{"protocol": {"M": 5}}`` -> ``{"protocol.M":
    5}``)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


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
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. attribution.protocol.M=5")
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


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    quiet: bool = False,
) -> T:
    """Defaults of ``cls``, updated by the file at ``path`` and then by ``overrides``.

    Old key names in the file and in the overrides are resolved before the overrides apply
    (each noted once unless ``quiet``: a saved run's ``config.json``)."""
    data = read_file(path) if path is not None else {}
    with quiet_aliases(quiet):
        data = canonical(cls, data)
        sets = [_canonical_override(cls, item) for item in overrides or []]
        return from_dict(cls, apply_overrides(data, sets))
