"""The starter spec `dflashctl init` writes: every section and field, its default, and what it means.

Generated from the spec's dataclasses, so it never drifts from them: a field's comment is its
docstring in dflash_jobs/spec.py and its value the default, unless the caller sets it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any

import yaml

from dflash_jobs.spec import RunSpec, parse_spec

COMMENT_WIDTH = 100

HEADER = """\
# dflash.yaml: one DFlash drafter run (DESIGN.md section 2). Every field below shows its default.
#   dflashctl plan      validate it and see the bill (tokens, storage, GPU-hours, upload rate)
#   dflashctl run       prepare, extract, verify, train and evaluate

"""

SECTION_NOTES = {
    "target": "The model the drafter learns to draft for.",
    "data": "Training conversations, tokenized by `dflashctl prepare` into <output>/tokens.",
    "storage": "S3 settings of every s3:// location (output, data.source, target.model).",
    "extract": "Hidden-state extraction: one GPU pod per shard.",
    "train": "The drafter and its training Job.",
    "eval": "Speculative decoding with the trained drafter on held-out prompts.",
    "cluster": "Kubernetes (backend: kubernetes).",
    "local": "The local backend (backend: local): the same pods as local processes.",
}

STARTER_VALUES: dict[str, Any] = {
    "name": "qwen36-27b-v1",
    "target": {"model": "/models/Qwen3.6-27B"},
    "data": {"source": "s3://my-bucket/chats.jsonl"},
    "output": "s3://my-bucket/dflash/qwen36-27b-v1",
    "cluster": {"model_volume": {"claim": "models", "mount": "/models"}},
}
"""What `dflashctl init` fills in beyond the defaults: the required fields, and the model PVC that
target.model lives on."""


def starter_spec(values: dict[str, Any] = STARTER_VALUES) -> str:
    """The commented spec with `values` (a nested mapping, required fields included) over the defaults."""
    lines = HEADER.splitlines()
    _render(RunSpec, values, indent=0, lines=lines)
    text = "\n".join(lines) + "\n"
    parse_spec(yaml.safe_load(text))  # a starter that does not parse is a bug here, not the user's
    return text


def _render(cls: type, values: dict[str, Any], *, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _dataclass_in(hints[f.name])
        value = values[f.name] if f.name in values else _default(f)
        note = SECTION_NOTES.get(f.name) if cls is RunSpec and section else docs.get(f.name) or _choices(hints[f.name])
        if section and indent == 0:
            lines.append("")
        if note:
            lines.extend(textwrap.wrap(note, COMMENT_WIDTH - indent, initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# "))
        if section and value is not None:
            lines.append(f"{pad}{f.name}:")
            nested = value if isinstance(value, dict) else {}
            _render(section, nested, indent=indent + 2, lines=lines)
        else:
            lines.append(f"{pad}{f.name}: {_scalar(value)}")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"the starter spec needs a value for the required field {f.name}")


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass of a field annotated `Section` or `Section | None`."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)), None)
    return None


def _choices(tp: Any) -> str | None:
    """A note for an undocumented field with a fixed set of values."""
    if typing.get_origin(tp) is typing.Literal:
        return "One of: " + ", ".join(str(arg) for arg in typing.get_args(tp)) + "."
    return None


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("...\n").strip()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields (the string right after `name: type = default`)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs
