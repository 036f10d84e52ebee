"""The documentation points at things that exist, so that a reader can follow it: every relative
link of the README and the docs resolves (the file, and the heading of an #anchor), every repository
path they name in code exists, every `dflashctl` command they show parses with the real command line
(the command in `dflashctl --help`, its options, its argument's choices), every spec key they name is
a field of the spec, every benchmark and every measured result is in bench/README.md, figures cite
result files that exist, docs/development.md's map of the code lists every module and folder of both
planes and no other, and the README's test command is what CI runs. Each check is also run on a
broken document, to show it finds what it is there to find."""

from __future__ import annotations

import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path

import pytest
import typer.main
from typer._click.exceptions import MissingParameter, UsageError  # typer vendors click: its parser raises these

from dflash_jobs.spec import RunSpec
from dflashctl.cli.app import app

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted({REPO / "README.md", REPO / "bench" / "README.md", REPO / "images" / "README.md",
               *(REPO / "docs").glob("*.md"), *(REPO / "k8s").rglob("*.md")})

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(])*\]\(([^)\s]+)\)")  # [text](target), images aside
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """Markdown without code blocks and inline code, where a [x](y) is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The #anchors GitHub gives the headings of a markdown file (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken_links(doc: Path) -> list[str]:
    """Every relative link of `doc` whose file, or whose #anchor's heading, does not exist."""
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The S3 credentials (`dflash-s3`)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\nSee [it](other.md#the-s3-credentials-dflash-s3), [top](#doc), [web](https://example.com/x).\n"
        "Broken: [gone](missing.md), [heading](other.md#nowhere), [here](#not-here).\n"
        "Not links: `[x](nothing.md)` and\n```\n[y](nothing.md)\n```\n"
    )
    assert broken_links(doc) == ["missing.md: no such file", "other.md#nowhere: no heading #nowhere in other.md",
                                 "#not-here: no heading #not-here in doc.md"]


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in first_block.splitlines()]
    assert commands == ["make setup", ".venv/bin/dflashctl demo"]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "make test" in ci
    assert re.search(r"^test:", (REPO / "Makefile").read_text(), re.M)
    assert "**The tests**: `make test` runs the whole suite, as CI does (`.ci/run`)" in readme


def code_spans(text: str) -> list[str]:
    """The code of a markdown text: each fenced block (its lines continued with a backslash joined)
    and each inline code span, of the prose or of a comment in a block."""
    blocks = [re.sub(r"\\\n\s*", " ", match.group(0).split("\n", 1)[1].rsplit("\n", 1)[0]) for match in FENCE.finditer(text)]
    return blocks + [span.strip("`") for span in INLINE_CODE.findall(text)]


COMMAND = re.compile(r"(?<![\w-])dflashctl[ \t]+([^\n]*)")
COMMAND_END = re.compile(r"\||;|&&|\s\$\(")  # a pipe, the next command
COMMENT = re.compile(r"(?:^|\s)#.*$", re.M)
PLACEHOLDER = re.compile(r"<[^<>\n]*>")  # <run name>: one argument, whatever its words


def shown_commands(text: str) -> list[list[str]]:
    """The arguments of every `dflashctl ...` a markdown text shows in code (comments aside), up
    to a pipe or the next command on the line."""
    commands = []
    for span in code_spans(text):
        for match in COMMAND.finditer(COMMENT.sub("", span)):
            line = PLACEHOLDER.sub("PLACEHOLDER", COMMAND_END.split(match.group(1), 1)[0])
            try:
                arguments = shlex.split(line)
            except ValueError:
                arguments = line.split()
            if arguments:
                commands.append(arguments)
    return commands


def command_errors(arguments: list[str]) -> list[str]:
    """Why `dflashctl ARGUMENTS` would not parse: the command is not in `dflashctl --help`, or its
    parser refuses an option or an argument. Required options left out are no error: prose names a
    command without them."""
    group = typer.main.get_command(app)
    global_options = {opt for param in group.params for opt in param.opts + param.secondary_opts}
    arguments = list(arguments)
    while arguments and arguments[0] in global_options - {"--version"}:
        arguments = arguments[2:]
    shown = " ".join(arguments)
    if not arguments or arguments[0] in ("--help", "-h", "--version"):
        return []
    name, *rest = arguments
    command = group.commands.get(name)
    if command is None or command.hidden:
        return [f"dflashctl {shown}: no command {name!r} in dflashctl --help"]
    try:
        command.make_context(name, rest, parent=group.make_context("dflashctl", [name], resilient_parsing=True))
    except MissingParameter:
        pass
    except UsageError as error:
        return [f"dflashctl {shown}: {error.format_message()}"]
    return []


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_command_shown_parses(doc):
    commands = shown_commands(doc.read_text())
    assert [error for arguments in commands for error in command_errors(arguments)] == []


def test_the_readme_shows_the_quickstart_commands():
    commands = {arguments[0] for arguments in shown_commands((REPO / "README.md").read_text())}
    assert {"check", "stage-model", "plan", "run", "status", "logs", "demo"} <= commands


def test_the_command_check_finds_a_missing_command_a_wrong_option_and_a_wrong_choice():
    doc = (
        "```bash\ndflashctl status -w        # watch\ndflashctl logs --shard 3 -F | grep tokens\n"
        "dflashctl -n team-a render controller -d k8s/runs/<run name>/\n.venv/bin/dflashctl demo   # dflashctl and more\n```\n"
        "Then `dflashctl stage-model` (its --from left out), `dflashctl watch`, `dflashctl logs --lines 5`, "
        "`dflashctl logs trainer -F`.\n"
        "```bash\ndflashctl logs -F   # `dflashctl logs --shard x` in a comment\n```\n"
    )
    commands = shown_commands(doc)
    assert commands[:4] == [["status", "-w"], ["logs", "--shard", "3", "-F"],
                            ["-n", "team-a", "render", "controller", "-d", "k8s/runs/PLACEHOLDER/"], ["demo"]]
    errors = [error for arguments in commands for error in command_errors(arguments)]
    assert len(errors) == 4, errors
    assert errors[0] == "dflashctl watch: no command 'watch' in dflashctl --help"
    assert "--lines" in errors[1] and "trainer" in errors[2] and "--shard" in errors[3]


SPEC_KEY = re.compile(r"(?<![\w/.$-])((?:%s)(?:\.[a-z_][a-z0-9_]*)+)(?![\w/-])"
                      % "|".join(field.name for field in dataclasses.fields(RunSpec)))
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "yml", "md", "png", "safetensors", "sh", "txt"}


def spec_field(key: str) -> bool:
    """Whether a dotted key (`train.dspark.ce_only`) names a field of RunSpec."""
    spec_type: typing.Any = RunSpec
    for name in key.split("."):
        if typing.get_origin(spec_type) in (typing.Union, types.UnionType):
            spec_type = next(arg for arg in typing.get_args(spec_type) if arg is not type(None))
        if not dataclasses.is_dataclass(spec_type):
            return False
        hints = typing.get_type_hints(spec_type)
        if name not in hints:
            return False
        spec_type = hints[name]
    return True


def named_spec_keys(text: str) -> set[str]:
    """The dotted spec keys a markdown text names (`cluster.image`), file names aside (`train.py`)."""
    return {key for key in SPEC_KEY.findall(text) if key.rsplit(".", 1)[1] not in FILE_SUFFIXES}


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_spec_key_named_is_a_field(doc):
    assert sorted(key for key in named_spec_keys(doc.read_text()) if not spec_field(key)) == []


def test_the_spec_key_check_finds_a_key_that_is_not_a_field():
    text = ("Set `cluster.image`, `train.dspark.ce_only: true` and generate.max_new_tokens; not `train.blocksize` "
            "nor cluster.image.tag; `bench/train.py`, `dflash_jobs.train.loop` and `data.json` are no keys.")
    keys = named_spec_keys(text)
    assert keys == {"cluster.image", "train.dspark.ce_only", "generate.max_new_tokens", "train.blocksize", "cluster.image.tag"}
    assert sorted(key for key in keys if not spec_field(key)) == ["cluster.image.tag", "train.blocksize"]


REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:\.ci|bench|controller|docs|examples|images|jobs|k8s|tests)/[\w.*/-]*[\w*/])")
READERS_OWN = "k8s/runs/"
"""Where the reader's run directories go (`dflashctl render controller -d k8s/runs/<run>/`): examples, not files of the repository."""


def missing_paths(text: str) -> list[str]:
    """Every repository path (or glob) a markdown text names in code that does not exist."""
    paths = {path.rstrip("/") for span in code_spans(text) for path in REPO_PATH.findall(span)}
    return sorted(path for path in paths if not path.startswith(READERS_OWN) and not any(REPO.glob(path)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_repository_path_named_exists(doc):
    assert missing_paths(doc.read_text()) == []


def test_the_path_check_finds_a_missing_path():
    text = ("Run `tests/k8s_fake_api.py`, `pytest tests/test_faults_*.py tests/test_nothing_*.py` and\n```bash\n"
            "kubectl apply -k k8s/overlays/rtx-pro-6000\npython bench/nothing.py --out $OUT/x.json\n"
            "dflashctl render controller -d k8s/runs/qwen36-27b-v2/\n```\n")
    assert missing_paths(text) == ["bench/nothing.py", "tests/test_nothing_*.py"]


def test_every_benchmark_and_every_result_is_in_the_bench_readme():
    bench = REPO / "bench"
    text = (bench / "README.md").read_text()
    scripts = sorted(str(path.relative_to(REPO)) for path in [*bench.rglob("*.py"), *bench.glob("*.sh")])
    assert scripts and [script for script in scripts if f"`{script}`" not in text] == []
    results = sorted(path.name for path in (bench / "results").iterdir())
    assert results and [name for name in results if f"`{name}`" not in text] == []


MAPPED_PACKAGES = ("jobs/dflash_jobs", "controller/dflashctl")
"""The packages whose every module and folder docs/development.md's map of the code lists."""


def map_entries(text: str, package: str) -> list[list[str]]:
    """The code spans of each line of the map's list under `package` (a line starts at its `- `):
    the first names a module or folder of the package, the others what it holds."""
    block = text.split(f"`{package}/`,", 1)[1].split("\n\n", 2)[1]  # the heading line, a blank line, the list
    lines = re.split(r"^- ", block, flags=re.M)[1:]
    return [[span.strip("`") for span in INLINE_CODE.findall(line)] for line in lines]


def map_errors(text: str, package: str, root: Path) -> list[str]:
    """What the map of `package` (its files under `root`) gets wrong: a module or folder it does not list,
    one it lists that is not there, and a module a folder's line names that the folder does not hold."""
    entries = map_entries(text, package)
    listed = [spans[0] for spans in entries]
    present = {f"{path.name}/" if path.is_dir() else path.name for path in root.iterdir()
               if (path.is_dir() and path.name not in ("__pycache__",) and not path.name.startswith("."))
               or (path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"))}
    errors = [f"{name}: not in the map" for name in sorted(present - set(listed))]
    errors += [f"{name}: listed, not in {package}" for name in listed if name not in present]
    errors += [f"{spans[0]}{held}: not there" for spans in entries if spans[0].endswith("/") and (root / spans[0]).is_dir()
               for held in spans[1:] if held.endswith(".py") and not (root / spans[0] / held).is_file()]
    return errors


@pytest.mark.parametrize("package", MAPPED_PACKAGES)
def test_the_code_map_lists_every_module_and_folder_that_is_there(package):
    assert map_errors((REPO / "docs" / "development.md").read_text(), package, REPO / package) == []


def test_the_code_map_check_finds_a_missing_an_extra_and_a_misplaced_module(tmp_path):
    (tmp_path / "pkg" / "capture").mkdir(parents=True)
    for name in ("__init__.py", "shard.py", "units.py", "capture/runner.py"):
        (tmp_path / "pkg" / name).write_text("")
    text = ("`pkg/`, a package.\n\n- `shard.py`: what every shard does.\n- `tiny.py`: gone.\n"
            "- `capture/`: the target run\n  (`runner.py`, `target.py`).\n\nBeside the code:\n")
    assert map_errors(text, "pkg", tmp_path / "pkg") == ["units.py: not in the map", "tiny.py: listed, not in pkg", "capture/target.py: not there"]


RESULT_NAME = re.compile(r"`(?:bench/results/)?([\w.-]+-(?:h200|cpu|gpu)[\w.-]*\.(?:json|png)|prepare\.json)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_cited_result_file_exists(doc):
    cited = set(RESULT_NAME.findall(doc.read_text()))
    assert [name for name in sorted(cited) if not (REPO / "bench" / "results" / name).is_file()] == []


def test_the_drafter_table_states_the_codes_blocks_and_serving_and_the_measured_steps():
    """README's drafter variants: each row's default block, drafts, vLLM method and minimum release are
    the code's (anchors.anchor_layout, serving.SERVED), its step, MFU and memory train-variants-h200.json's."""
    import json

    from dflash_jobs.spec import anchor_layout
    from dflash_jobs.drafter.serving import SERVED

    section = (REPO / "README.md").read_text().split("### Drafter variants\n", 1)[1].split("\n#", 1)[0]
    rows = {row.split("|")[1].split()[0].strip("`"): row for row in section.splitlines() if row.startswith("| `d")}
    measured = {case["drafter"]: case for case in json.loads((REPO / "bench/results/train-variants-h200.json").read_text())["cases"]}
    assert rows.keys() == {served.drafter for served in SERVED.values()} == measured.keys()
    for served in SERVED.values():
        row, layout, case = rows[served.drafter], anchor_layout(served.drafter), measured[served.drafter]
        assert f"| {layout.block_size} ({layout.drafts}) |" in row
        assert f"`method: {served.method}`" in row
        assert ("V2 runner" in row) == served.v2_runner
        assert (f"vLLM >= {served.min_vllm}" in row) if served.min_vllm else ("vLLM >=" not in row)
        assert f"{case['step_s']:.3f} s" in row and f"{100 * case['mfu']:.1f}%" in row and f"{case['peak_allocated_gib']:.1f} GiB" in row
