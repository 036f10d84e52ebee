"""The edge: a YAML document turned into a RunSpec, every value checked against its field's type
on the way, so that a bad one fails naming its field, what it is and what is allowed. Every bad
field is reported, not the first alone: each section gathers its fields' errors (their types here,
and a nested section's own checks, which its constructor makes), and one SpecError carries them all."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_jobs.errors import SpecError, SpecFileError
from dflash_jobs.spec.run import RunSpec

DEFAULT_SPEC_FILE = "dflash.yaml"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of strings"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


YAML12_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
"""A number as YAML 1.2 (and kubectl, Go, JSON) reads it. PyYAML reads YAML 1.1, where a float needs a
dot: `lr: 6e-4` arrives as the string "6e-4". A float field takes such a string as the number the
user wrote; anything else that is not a number (`lr: fast`, `.inf`, `1_000`) is still refused."""


def _as_integer_hint(value: Any) -> str:
    """For an integer field given `1e6` (a string to YAML 1.1) or `1.0e+6`: how to write it."""
    text = value if isinstance(value, str) and YAML12_FLOAT.match(value) else None
    number = float(text) if text is not None else value if isinstance(value, float) else None
    if number is None or not number.is_integer():
        return ""
    read = f"YAML read {text} as a string: " if text is not None else ""
    return f" ({read}write {int(number)})"


def _convert(path: str, value: Any, tp: Any) -> Any:
    """Checks `value` against the annotation `tp`, building nested dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        section = next((arg for arg in args if dataclasses.is_dataclass(arg)), None)
        if section is not None and isinstance(value, dict):
            return _build(path, value, section)  # an optional section: its own field names the error
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(path, value, arg)
            except SpecError:
                continue
        raise SpecError(path, value, _type_name(tp))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise SpecError(path, value, _type_name(tp))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, value, _type_name(tp))
        (item,) = typing.get_args(tp)
        return list(_gathered({i: (f"{path}[{i}]", v, item) for i, v in enumerate(value)}, []).values())
    if origin is dict:
        if typing.get_args(tp)[1] is Any:  # Kubernetes objects in their own spelling (affinity, a patch)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise SpecError(path, value, "a mapping with string keys")
            return copy.deepcopy(value)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise SpecError(path, value, "a mapping of strings to strings")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(path, value, tp)
    if tp is float:
        if isinstance(value, str) and YAML12_FLOAT.match(value):
            return float(value)  # 6e-4: a number in YAML 1.2, a string to PyYAML's YAML 1.1 (see YAML12_FLOAT)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, value, "a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, value, "an integer" + _as_integer_hint(value))
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, value, "a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, value, "true or false")
        return value
    raise TypeError(f"unsupported spec annotation {tp!r} at {path}")


def _build(path: str, raw: Any, cls: type) -> Any:
    """The section `cls` from its mapping; a SpecError with every bad key and field of it (SpecError.of)."""
    prefix = f"{path}." if path else ""
    if not isinstance(raw, dict):
        raise SpecError(path or "spec", raw, "a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors = [SpecError(f"{prefix}{key}", raw[key], f"one of the known keys: {', '.join(fields)}") for key in sorted(set(raw) - set(fields))]
    errors += [
        SpecError(f"{prefix}{name}", None, f"a value: {name} is required") for name, f in fields.items()
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    known = {name: (f"{prefix}{name}", value, hints[name]) for name, value in raw.items() if name in fields}
    return cls(**_gathered(known, errors))


def _gathered(values: dict[Any, tuple[str, Any, Any]], errors: list[SpecError]) -> dict[Any, Any]:
    """Each of `values` ({key: (path, value, type)}) converted, by key; every one that is bad added
    to `errors`, which are raised together (SpecError.of) if there are any."""
    converted = {}
    for key, (path, value, tp) in values.items():
        try:
            converted[key] = _convert(path, value, tp)
        except SpecError as error:
            errors.append(error)
    if errors:
        raise SpecError.of(errors)
    return converted


def parse_spec(raw: Any) -> RunSpec:
    """Builds a validated RunSpec from a parsed YAML document."""
    return _build("", raw, RunSpec)


def load_spec(path: str | Path) -> RunSpec:
    """Reads and validates a spec file. Raises SpecFileError naming the file when it is unreadable."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecFileError(path, "does not exist", "`dflashctl init` writes a starter dflash.yaml; -f names another file") from None
    except OSError as exc:
        raise SpecFileError(path, f"cannot be read ({exc.strerror})", "Fix its permissions, or name another file with -f") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecFileError(path, f"is invalid YAML{where}", "Write a YAML mapping (see `dflashctl init`)") from None
    return parse_spec(raw)


def dump_spec(spec: RunSpec) -> str:
    """The resolved spec as YAML, deterministic (written to <output>/run.yaml and into the ConfigMap)."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False, default_flow_style=False)
