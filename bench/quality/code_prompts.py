"""Real prompts that no one here wrote: the public functions and methods of Python source (the
standard library, and installed packages where a size asks for more), read with `ast` (no module
is imported), each made into chats of several kinds, answered by the code's own writer.

A function qualifies when it is public (no leading underscore, nor its class's, nor its module's),
is a module's function or a method of a module's class, has a docstring of MIN_DOCSTRING_CHARS or
more, and a source under MAX_SOURCE_CHARS. The kinds (KINDS), each a chat of another shape:

- "write": its signature and docstring, "write this function"; answered by its real source.
- "explain": its code without the docstring, "explain what it does"; answered by the docstring,
  the writer's own explanation of that code. Code in the prompt, prose in the answer: the other
  way round from "write".
- "doctest": its signature and the docstring's prose, "write doctest examples"; answered by the
  docstring's own examples. Only where the docstring has them: a test the code's writer wrote and
  checked against the code. Tests written elsewhere (a test suite's) would need matching a test to
  the function it tests, which the source does not say.

The answers are another writer's than the target's, as a real data set's are: regenerating them
with the target is what the generate step is for.

Held out by group: a group is a top-level module or package of a source root (the standard
library's `email`, `json`, `os`; torch's `nn`), and the held-out prompts come from groups no
training prompt comes from, so no held-out function's module was seen in training. Everything is
deterministic given the seed and the source read.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import sysconfig
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

MIN_DOCSTRING_CHARS = 40
MAX_SOURCE_CHARS = 2500
SKIPPED_DIRECTORIES = {"test", "tests", "testing", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "_vendor", "vendored"}
"""Test suites (their functions test others, they are not an API), vendored copies and demos."""
DOCTEST_PROMPT = ">>>"


@dataclass(frozen=True, slots=True)
class Function:
    """One qualifying function or method, its text dedented."""

    group: str
    """`root:top`: the top-level module or package it belongs to, within its source root."""
    module: str
    qualname: str
    """`name`, or `Class.name` for a method."""
    signature: str
    """Its decorators and `def` lines, up to the docstring."""
    docstring: str
    """As `ast.get_docstring` cleans it."""
    body: str
    """Its code after the docstring ("" when the docstring is all of it)."""
    source: str


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True, slots=True)
class SourceRoot:
    label: str
    directory: Path
    package: str = ""
    """Its modules' names start with it (a package's; "" for the standard library's)."""


def source_roots(packages: Sequence[str] = ()) -> list[SourceRoot]:
    """The standard library, then each installed package (located, not imported)."""
    roots = [SourceRoot("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package {package!r} is not installed as a package here: drop it from the size's packages or install it")
        roots.append(SourceRoot(package, Path(next(iter(spec.submodule_search_locations))), package))
    return roots


def is_public_module(relative: Path) -> bool:
    """A module of the API: not a test's, a vendored copy's or a demo's, nor private."""
    return (relative.suffix == ".py" and not SKIPPED_DIRECTORIES & set(relative.parts)
            and not any(is_private(part) for part in relative.with_suffix("").parts))


def module_files(root: Path) -> list[Path]:
    """The root's public modules, in path order."""
    return sorted(path for path in root.rglob("*.py") if is_public_module(path.relative_to(root)))


def functions_in(root: SourceRoot, path: Path) -> Iterator[Function]:
    """The qualifying functions and methods of one module file (none if it does not parse)."""
    text = path.read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    yield from functions_in_tree(root.label, root.package, path.relative_to(root.directory), text, tree)


def functions_in_tree(label: str, package: str, relative: Path, text: str, tree: ast.Module) -> Iterator[Function]:
    """The qualifying functions and methods of one parsed module, at `relative` in the source root
    `label` whose modules' names start with `package`."""
    lines = text.splitlines()
    top = relative.with_suffix("").parts[0]
    group = f"{label}:{label if top == '__init__' else top}"
    module = ".".join(part for part in (package, module_name(relative)) if part)

    def text_of(first: int, last: int) -> str:
        """Lines first..last (1-based, inclusive), dedented."""
        return textwrap.dedent("\n".join(lines[first - 1 : last])).strip("\n")

    def qualifying(node: ast.AST, owner: str) -> Function | None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_private(node.name):
            return None
        docstring = ast.get_docstring(node)
        if not docstring or len(docstring) < MIN_DOCSTRING_CHARS:
            return None
        first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
        source = text_of(first, node.end_lineno)
        documented = node.body[0]
        if len(source) >= MAX_SOURCE_CHARS or documented.lineno == node.lineno:  # a one-line def holds its docstring
            return None
        # Comments between the docstring and the code are the code's.
        body = text_of(documented.end_lineno + 1, node.end_lineno) if documented.end_lineno < node.end_lineno else ""
        return Function(group, module, owner + node.name, text_of(first, documented.lineno - 1), docstring, body, source)

    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not is_private(node.name):
            found = (qualifying(method, f"{node.name}.") for method in node.body)
        else:
            found = iter([qualifying(node, "")])
        yield from (function for function in found if function is not None)


def read_functions(roots: Sequence[SourceRoot]) -> list[Function]:
    return [function for root in roots for path in module_files(root.directory) for function in functions_in(root, path)]


# ---- the kinds of chat -------------------------------------------------------------------------


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def with_docstring(signature: str, docstring: str) -> str:
    """The signature and the docstring as the function's first statement (re-indented, as cleaned)."""
    quoted = '"""' + docstring.replace('"""', r'\"\"\"') + ("\n" if "\n" in docstring else "") + '"""'
    return signature + "\n" + textwrap.indent(quoted, " " * 4)


def where(function: Function) -> str:
    return f"`{function.qualname}` from the Python module `{function.module}`"


def write_chat(function: Function) -> tuple[str, str] | None:
    prompt = f"Write {where(function)}, from its signature and docstring:\n\n{fenced(with_docstring(function.signature, function.docstring))}"
    return prompt, fenced(function.source)


TRIVIAL_BODIES = {"pass", "...", "raise NotImplementedError", "raise NotImplementedError()"}


def explain_chat(function: Function) -> tuple[str, str] | None:
    """None where the code without its docstring does nothing to explain (an abstract method)."""
    if function.body.strip() in TRIVIAL_BODIES | {""}:
        return None
    code = function.signature + "\n" + textwrap.indent(function.body, " " * 4)
    return f"Explain what {where(function)} does:\n\n{fenced(code)}", function.docstring


def doctest_chat(function: Function) -> tuple[str, str] | None:
    """None where the docstring has no examples, or nothing before them."""
    lines = function.docstring.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith(DOCTEST_PROMPT)), None)
    if start is None:
        return None
    prose, examples = "\n".join(lines[:start]).strip(), textwrap.dedent("\n".join(lines[start:])).strip()
    if not prose:
        return None
    prompt = f"Write doctest examples for {where(function)}:\n\n{fenced(with_docstring(function.signature, prose))}"
    return prompt, examples


def returns_chat(function: Function) -> tuple[str, str] | None:
    """The code without its docstring, and a doctest call of it: what does it show? Answered by the
    doctest's own expected output (its first example with one, after the statements before it)."""
    if not function.body.strip():
        return None
    lines = function.docstring.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        expected = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if (stripped.startswith(DOCTEST_PROMPT + " ") and expected and not expected.startswith((DOCTEST_PROMPT, "...", "Traceback"))):
            setup = [l.strip() for l in lines[:i] if l.strip().startswith((DOCTEST_PROMPT, "... "))]
            session = "\n".join([*setup, stripped])
            code = function.signature + "\n" + textwrap.indent(function.body, " " * 4)
            prompt = f"Given {where(function)}:\n\n{fenced(code)}\n\nWhat does the last line of this session show?\n\n{fenced(session)}"
            return prompt, expected
    return None


def without_annotations(source: str) -> str | None:
    """The function's code with every parameter's and the return's annotation taken out (None if it
    has none, or its text does not parse alone: a string literal that dedenting could not shift)."""
    try:
        node = ast.parse(source).body[0]
    except SyntaxError:
        return None
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, *filter(None, (node.args.vararg, node.args.kwarg))]
    if node.returns is None and all(argument.annotation is None for argument in arguments):
        return None
    node.returns = None
    for argument in arguments:
        argument.annotation = None
    return ast.unparse(node)


def annotate_chat(function: Function) -> tuple[str, str] | None:
    """The code without its type hints (as `ast.unparse` writes it), "add them"; answered by the
    signature its writer annotated."""
    bare = without_annotations(function.source)
    if bare is None:
        return None
    return f"Add type hints to the signature of {where(function)}:\n\n{fenced(bare)}", fenced(function.signature)


KINDS: dict[str, Callable[[Function], tuple[str, str] | None]] = {"write": write_chat, "explain": explain_chat, "doctest": doctest_chat}
MORE_KINDS: dict[str, Callable[[Function], tuple[str, str] | None]] = {"returns": returns_chat, "annotate": annotate_chat}
"""Kinds the packages' source gives (package_prompts.py); the code task's sizes keep to KINDS."""


@dataclass(frozen=True, slots=True)
class CodeChat:
    kind: str
    group: str
    prompt: str
    answer: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def code_chats(functions: Sequence[Function], kinds: Sequence[str]) -> list[CodeChat]:
    """Every chat of the given kinds, each prompt once (the first function that asks it)."""
    every = KINDS | MORE_KINDS
    unknown = set(kinds) - set(every)
    if unknown:
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}: the kinds are {list(every)}")
    chats, seen = [], set()
    for function in functions:
        for kind in kinds:
            made = every[kind](function)
            if made is not None and made[0] not in seen:
                seen.add(made[0])
                chats.append(CodeChat(kind, function.group, *made))
    return chats


@dataclass(frozen=True, slots=True)
class CodeSplit:
    training: list[CodeChat]
    held_out: list[CodeChat]
    """The kinds in turn (the first n prompts an evaluation takes cover every kind)."""
    held_out_groups: list[str]
    available: dict[str, dict[str, int]]
    """Chats of each kind in the held-out groups and in the others, before sampling."""


def split_by_group(chats: Sequence[CodeChat], *, training: int, held_out: int, kinds: Sequence[str], seed: int,
                   held_out_roots: Sequence[str] = ("stdlib",)) -> CodeSplit:
    """`held_out` chats, as many of each kind as can be (the first kinds take the remainder), from
    groups of `held_out_roots` taken in a seeded random order while a kind they have is short; then
    up to `training` chats drawn from every other group (of any root: the packages read beside the
    standard library add training data, the held-out prompts stay of one population at every size)."""
    rng = random.Random(seed)
    groups = sorted({chat.group for chat in chats if chat.group.split(":", 1)[0] in held_out_roots})
    rng.shuffle(groups)
    quota = {kind: held_out // len(kinds) + (i < held_out % len(kinds)) for i, kind in enumerate(kinds)}
    by_group: dict[str, list[CodeChat]] = {}
    for chat in chats:
        by_group.setdefault(chat.group, []).append(chat)
    taken: list[str] = []
    pool: Counter[str] = Counter()
    for group in groups:
        # A group is held out only for a kind still short: a rare kind then takes the few groups
        # that have it, not every group until it happens upon enough.
        if any(pool[kind] < quota[kind] and any(chat.kind == kind for chat in by_group[group]) for kind in kinds):
            taken.append(group)
            pool.update(chat.kind for chat in by_group[group])
    short = {kind: (pool[kind], quota[kind]) for kind in kinds if pool[kind] < quota[kind]}
    if short:
        raise ValueError(f"the source holds too few chats of some kinds to hold out (found, wanted): {short}; "
                         "hold out fewer, read more source (packages), or allow longer prompts")
    held_groups = set(taken)
    sampled = {kind: rng.sample([c for g in taken for c in by_group[g] if c.kind == kind], quota[kind]) for kind in kinds}
    interleaved = [sampled[kind][i] for i in range(max(quota.values())) for kind in kinds if i < quota[kind]]
    others = [chat for chat in chats if chat.group not in held_groups]
    train = rng.sample(others, min(training, len(others)))
    available = {"held_out_groups": dict(Counter(c.kind for g in taken for c in by_group[g])), "training_groups": dict(Counter(c.kind for c in others))}
    return CodeSplit(train, interleaved, sorted(held_groups), available)
