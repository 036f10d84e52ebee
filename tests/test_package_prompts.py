"""Code prompts from package archives (bench/quality/package_prompts.py), over a wheel and an sdist
this test writes itself (the suite downloads nothing): every kind, held out by package, the skipped
and the unparsable counted and named, over-long prompts dropped and counted, the same bytes twice."""

from __future__ import annotations

import importlib
import io
import json
import lzma
import tarfile
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality"

MODULE = '''
"""A module."""

def scaled(values: list[float], factor: float = 2.0) -> list[float]:
    """Every value times factor, a docstring long enough to make a prompt of.

    >>> scaled([1.0, 2.5])
    [2.0, 5.0]
    """
    return [value * factor for value in values]


class Box:
    def area(self, width, height):
        """The area of a box of these sides, in the units of its sides."""
        # the code's own comment
        return width * height
'''


def wheel(cache: Path, name: str, version: str, modules: dict[str, str]) -> Path:
    path = cache / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in sorted(modules.items()):
            z.writestr(member, text)
        z.writestr(f"{name}-{version}.dist-info/METADATA", "Name: " + name)
    return path


def sdist(cache: Path, name: str, version: str, modules: dict[str, str]) -> Path:
    path = cache / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for member, text in sorted(modules.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{member}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def packages(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("package_prompts")
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel(cache, "alpha", "1.0", {"alpha/__init__.py": MODULE, "alpha/broken.py": "def (:\n", "alpha/tests/test_x.py": MODULE,
                                  "alpha/_private.py": MODULE.replace("scaled", "hidden")})
    sdist(cache, "beta", "2.0", {"src/beta/core.py": MODULE.replace("scaled", "stretched").replace("Box", "Crate"),
                                 "docs/conf.py": MODULE, "setup.py": MODULE})
    (cache / "gamma-3.0-py3-none-any.whl").write_bytes(b"not a zip")
    return module, cache


PINS = ("alpha==1.0", "beta==2.0", "gamma==3.0", "delta==4.0")


def lines_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in lzma.decompress((out / "code-prompts.jsonl.xz").read_bytes()).decode().splitlines()]


def test_archives_become_chats_of_every_kind_held_out_by_package(packages, tmp_path):
    module, cache = packages
    summary = module.build(cache, tmp_path / "out", pins=PINS, held_out=("beta",))
    lines = lines_of(tmp_path / "out")
    train = [line for line in lines if line["split"] == "train"]
    held = [line for line in lines if line["split"] == "held_out"]
    assert {line["package"] for line in train} == {"alpha"} and {line["package"] for line in held} == {"beta"}
    assert {line["kind"] for line in train} == {line["kind"] for line in held} == {"write", "explain", "doctest", "returns", "annotate"}
    # Only the public modules of the package: not its tests, its private module, an sdist's docs or setup.py.
    assert not any("hidden" in line["messages"][0]["content"] for line in lines)
    assert summary["packages"]["alpha"]["modules"] == 2 and summary["packages"]["beta"]["modules"] == 1
    assert summary["unparsable_modules"] == summary["packages"]["alpha"]["unparsable_modules"] == 1
    assert summary["chats"] == {"train": len(train), "held_out": len(held)}
    assert set(summary["skipped_packages"]) == {"gamma==3.0", "delta==4.0"}
    assert "unreadable" in summary["skipped_packages"]["gamma==3.0"] and "fetch" in summary["skipped_packages"]["delta==4.0"]
    assert summary["packages"]["beta"]["version"] == "2.0" and summary["file"]["bytes"] == (tmp_path / "out" / "code-prompts.jsonl.xz").stat().st_size
    returns = next(line for line in train if line["kind"] == "returns")["messages"][0]["content"]
    assert ">>> scaled([1.0, 2.5])" in returns and "[2.0, 5.0]" not in returns
    annotate = next(line for line in train if line["kind"] == "annotate")["messages"][0]["content"]
    assert "def scaled(values, factor=2.0):" in annotate and "list[float]" not in annotate
    assert all(list(line["messages"][0]) == ["role", "content"] and len(line["messages"]) == 1 for line in lines)


def test_the_same_archives_give_the_same_bytes_and_over_long_prompts_are_counted(packages, tmp_path):
    module, cache = packages
    first = module.build(cache, tmp_path / "a", pins=PINS, held_out=("beta",))
    again = module.build(cache, tmp_path / "b", pins=tuple(reversed(PINS)), held_out=("beta",))
    assert (tmp_path / "a" / "code-prompts.jsonl.xz").read_bytes() == (tmp_path / "b" / "code-prompts.jsonl.xz").read_bytes()
    assert first["dropped"]["over_length"] == {}
    short = module.build(cache, tmp_path / "c", pins=PINS, held_out=("beta",), max_prompt_chars=200)
    dropped = sum(short["dropped"]["over_length"].values())

    def kept(summary: dict) -> int:
        return sum(sum(package["chats"].values()) for package in summary["packages"].values())

    assert dropped > 0 and kept(short) == kept(first) - dropped
    assert all(len(line["messages"][0]["content"]) <= 200 for line in lines_of(tmp_path / "c"))


def test_a_prompt_shared_with_training_leaves_the_held_out_set(packages, tmp_path):
    """A held-out package that copies a training package's function keeps none of its prompts."""
    module, cache = packages
    wheel(cache, "copycat", "1.0", {"copycat/__init__.py": MODULE})
    summary = module.build(cache, tmp_path / "out", pins=(*PINS, "copycat==1.0"), held_out=("beta", "copycat"))
    # beta copies a method of alpha too (Crate.area is Box.area): its write and explain chats go as well.
    assert summary["dropped"]["shared_with_training"] == sum(summary["packages"]["copycat"]["chats"].values()) + 2 > 2
    assert not any(line["package"] == "copycat" for line in lines_of(tmp_path / "out"))


def test_bad_pins_and_held_out_packages_are_named(packages, tmp_path):
    module, cache = packages
    with pytest.raises(ValueError, match="'alpha' is not pinned as NAME==VERSION"):
        module.build(cache, tmp_path / "out", pins=("alpha",), held_out=())
    with pytest.raises(ValueError, match=r"held-out packages \['omega'\]"):
        module.build(cache, tmp_path / "out", pins=PINS, held_out=("omega",))
