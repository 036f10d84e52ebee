"""The quality benchmark at scale (issue 48): the packages' prompts (bench/quality/package_prompts.py)
as a task of their own (package_task.py: prompts alone, answered by the target, no source chain), a
part of the file that travels, the code-scale size's chains with online states, and, slow, every
chain of code-scale end to end on a tiny random target (SmolLM2 on 131K chats is the GPU's: the
code-scale size, bench/README.md).
"""

from __future__ import annotations

import importlib
import json
import os
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality"
TRAIN_MODULES = ("textwrap.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fractions.py", "statistics.py", "colorsys.py")
HELD_OUT_MODULES = ("calendar.py", "difflib.py")


@pytest.fixture
def quality(monkeypatch):
    """Imports a benchmark module as the script imports it (its directory on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def write_prompts(quality, out: Path) -> dict[str, int]:
    """A prompts file in package_prompts.py's format from real standard-library modules: the training
    prompts from some, the held-out ones from others (as the packages are held out); its split counts."""
    code_prompts, package_prompts = quality("code_prompts"), quality("package_prompts")
    root = code_prompts.SourceRoot("stdlib", Path(sysconfig.get_paths()["stdlib"]))
    kinds = (*code_prompts.KINDS, *code_prompts.MORE_KINDS)
    lines, counts = [], {}
    for split, modules in (("train", TRAIN_MODULES), ("held_out", HELD_OUT_MODULES)):
        functions = [f for module in modules for f in code_prompts.functions_in(root, root.directory / module)]
        chats = code_prompts.code_chats(functions, kinds)
        lines += [package_prompts.prompt_line(chat, chat.group, split) for chat in chats]
        counts[split] = len(chats)
    package_prompts.write_lines(out, lines)
    return counts


def test_a_part_of_the_prompts_file_is_a_prefix_of_its_short_training_prompts_and_every_held_out_one(quality, tmp_path):
    package_prompts = quality("package_prompts")
    counts = write_prompts(quality, tmp_path / "all")
    rows = package_prompts.read_lines(tmp_path / "all")
    summary = package_prompts.subset(tmp_path / "all", tmp_path / "part", train=10, max_prompt_chars=600)
    part = package_prompts.read_lines(tmp_path / "part")
    short = [row for row in rows if row["split"] == "train" and len(row["messages"][0]["content"]) <= 600]
    assert part[:10] == short[:10] and part[10:] == [row for row in rows if row["split"] == "held_out"]
    assert summary["chats"] == {"train": 10, "held_out": counts["held_out"]}
    assert json.loads((tmp_path / "part" / package_prompts.SUMMARY).read_text()) == summary
    with pytest.raises(ValueError, match=r"holds \d+ training prompts of at most 600 characters, not 100000: ask for fewer"):
        package_prompts.subset(tmp_path / "all", tmp_path / "more", train=100_000, max_prompt_chars=600)
    assert not (tmp_path / "more").exists()  # refused before anything was written
    with pytest.raises(FileNotFoundError, match="build it first"):
        package_prompts.read_lines(tmp_path / "nothing")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny random target's BPE tokenizer (trained on standard-library modules), as code-scale-tiny makes it."""
    from transformers import AutoTokenizer

    from dflash_jobs.architectures.tiny import write_tiny_target

    directory = tmp_path_factory.mktemp("tiny-target")
    write_tiny_target(directory, architecture="llama", num_layers=1, hidden_size=32, vocab_size=1024, heads=2, head_dim=16,
                      corpus=[(Path(sysconfig.get_paths()["stdlib"]) / module).read_text() for module in TRAIN_MODULES])
    return AutoTokenizer.from_pretrained(directory)


def test_the_package_task_takes_the_first_short_prompts_and_holds_out_the_kinds_in_turn(quality, tmp_path, tiny_tokenizer):
    package_task = quality("package_task")
    counts = write_prompts(quality, tmp_path / "p")
    rows = quality("package_prompts").read_lines(tmp_path / "p")
    task = package_task.PackagePromptsTask(package_task.RandomTarget(1, 32, 2, 16, 1024, 1), max_prompt_tokens=120, prompts=str(tmp_path / "p"))
    training, held_out, about = task.split(tiny_tokenizer, 24, 6)
    length = {row["messages"][0]["content"]: len(tiny_tokenizer(row["messages"][0]["content"], add_special_tokens=False)["input_ids"]) for row in rows}
    short = [row for row in rows if row["split"] == "train" and length[row["messages"][0]["content"]] <= 120]
    assert training == short[:24] and about["left_out_over_max_prompt_tokens"] > 0
    kinds = [row["kind"] for row in held_out]
    assert len(held_out) == 6 and all(row["split"] == "held_out" and length[row["messages"][0]["content"]] <= 120 for row in held_out)
    assert kinds[: len(set(kinds))] == sorted(set(kinds)) and len(set(kinds)) >= 3  # one of each kind in turn
    with pytest.raises(ValueError, match=r"the size asks \d+ and 6: build a larger part \(package_prompts.py subset --train N\)"):
        task.split(tiny_tokenizer, counts["train"], 6)
    missing = replace(task, prompts=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="pass --prompts DIR"):
        missing.split(tiny_tokenizer, 24, 6)


def test_the_code_scale_sizes_chains_train_online_without_a_source_chain(quality, tmp_path):
    import yaml

    import torch

    chains, sizes, bench = quality("chains"), quality("sizes"), quality("run_quality")
    for size_name in ("code-scale", "code-scale-full", "code-scale-131k", "code-scale-successors", "code-scale-tiny"):
        size = sizes.SIZES[size_name]
        names = [c.name for c in bench.chains_of(size)]
        # no source: the target wrote every answer
        assert names == ["regenerated", *[f"regenerated-{f:g}" for f in size.data_fractions], *[f"regenerated-{d}" for d in size.successors]]
        for chain in bench.chains_of(size):
            spec = yaml.safe_load(chains.write_spec(tmp_path / size_name / chain.name, Path("t"), Path("d"), size, torch.device("cpu"),
                                                    chain, final_hidden=False).read_text())
            assert spec["train"]["states"] == "online"
            # Online, a micro-batch's target forward is one: the budget holds its tokens.
            assert spec["extract"]["token_budget"] == max(8192, size.micro_batch_tokens)
            assert spec["eval"]["tree_budgets"] == (list(size.tree_budgets) if chain.name == "regenerated" else [])
            assert spec["eval"]["baselines"] == (["prompt_lookup", "bigram"] if chain.name == "regenerated" else [])
    # code-scale-full is code-scale but the data curve's chains.
    full, scale = sizes.SIZES["code-scale-full"], sizes.SIZES["code-scale"]
    assert [c.name for c in bench.chains_of(full)] == ["regenerated"] and replace(full, data_fractions=scale.data_fractions) == scale
    # code-scale-successors is code-scale-full with DFlash2 and DSpark beside DFlash; code-scale-131k is
    # code-scale-full on twice its training chats, the same held-out prompts.
    assert replace(sizes.SIZES["code-scale-successors"], successors=()) == full
    doubled = sizes.SIZES["code-scale-131k"]
    assert doubled.chat_counts.training == 2 * scale.chat_counts.training and doubled.chat_counts.held_out == scale.chat_counts.held_out
    assert replace(doubled, chats=full.chats) == full
    # code-scale-fp8: the data curve's middle point in bf16 and beside it a chain whose target computes
    # in FP8 (issue 50's parity), online on the regenerated chain's token chunks, no trees, no generation.
    fp8 = sizes.SIZES["code-scale-fp8"]
    assert replace(fp8, chats=full.chats, fp8_compute_chain=False) == full and fp8.chat_counts.training == scale.chat_counts.training // 2
    regenerated, computed = bench.chains_of(fp8)
    assert (computed.name, computed.compute_dtype, computed.states_of, computed.generates, computed.trees) == (
        "regenerated-fp8-compute", "float8", "regenerated", False, False)
    written = {c.name: yaml.safe_load(chains.write_spec(tmp_path / "fp8" / c.name, Path("t"), Path("d"), fp8, torch.device("cpu"), c,
                                                         final_hidden=False).read_text()) for c in (regenerated, computed)}
    assert {name: spec["extract"]["compute_dtype"] for name, spec in written.items()} == {
        "regenerated": "bfloat16", "regenerated-fp8-compute": "float8"}
    assert "generate" in written["regenerated"] and "generate" not in written["regenerated-fp8-compute"]
    from dflash_jobs.spec import parse_spec

    assert parse_spec(written["regenerated-fp8-compute"]).extract.compute_dtype == "float8"  # a field the extractor and trainer read
    figures = quality("figures")
    assert list(figures.seed_groups([regenerated, computed])) == ["regenerated", "regenerated-fp8-compute"]  # not a second seed of it
    # The sizes that store their states say so in every spec too.
    code_gpu = sizes.SIZES["code-gpu"]
    spec = yaml.safe_load(chains.write_spec(tmp_path / "g", Path("t"), Path("d"), code_gpu, torch.device("cpu"), bench.chains_of(code_gpu)[0],
                                            final_hidden=False).read_text())
    assert spec["train"]["states"] == "stored" and spec["extract"]["token_budget"] == 8192
    with pytest.raises(SystemExit, match="--prompts .*: the code-gpu size's task \\(code\\) reads no prompts file"):
        bench.with_prompts(code_gpu, "code-gpu", tmp_path)
    with pytest.raises(SystemExit, match="the tiny size's task \\(sorting\\) reads no prompts file"):
        bench.with_prompts(sizes.SIZES["tiny"], "tiny", tmp_path)
    # A task that reads a prompts file takes the directory given, the rest of the size as it was.
    scale = bench.with_prompts(sizes.SIZES["code-scale"], "code-scale", tmp_path / "." / "prompts")
    assert scale.task.prompts == str((tmp_path / "prompts").resolve()) and scale.chats == sizes.SIZES["code-scale"].chats
    assert bench.with_prompts(code_gpu, "code-gpu", None) is code_gpu


@pytest.mark.slow
def test_code_scale_runs_every_chain_online_on_a_tiny_random_target(quality, tmp_path):
    bench = quality("run_quality")
    try:
        write_prompts(quality, tmp_path / "prompts")
        out, workdir = tmp_path / "quality-code-scale-tiny.json", tmp_path / "w"
        assert bench.main(["--size", "code-scale-tiny", "--workdir", str(workdir), "--out", str(out), "--prompts", str(tmp_path / "prompts")]) == 0
        result = json.loads(out.read_text())
        size = bench.SIZES["code-scale-tiny"]
        assert result["complete"] and result["task"] == "package code" and result["same_prompts"]
        runs = result["runs"]
        # DFlash, the curve's chain, and the successors trained online on the regenerated chain's token chunks
        assert list(runs) == ["regenerated", "regenerated-0.25", "regenerated-dflash2", "regenerated-dspark"]
        assert all(run["lossless"] for run in runs.values())
        assert {name: run["drafter"] for name, run in runs.items()} == {
            "regenerated": "dflash", "regenerated-0.25": "dflash", "regenerated-dflash2": "dflash2", "regenerated-dspark": "dspark"}
        assert set(result["best_drafter"]["acceptance_length"]) == {"dflash", "dflash2", "dspark"}
        assert result["best_drafter"]["verdict"] == "not decided"  # 5 held-out prompts decide nothing
        for name in runs:  # online: the target ran in the training step, nothing extracted or stored
            run = workdir / name / "run"
            assert (run / "tokens").is_dir() and not (run / "extract").exists() and (run / "train" / "drafter" / "config.json").is_file()
        assert set(runs["regenerated"]["drafters"]) == {"dflash", "prompt_lookup", "bigram"}
        chats = result["data"]["chats"]
        assert chats["training"] == size.chats - size.holdout and chats["held_out"] == size.holdout and chats["duplicate_prompts"] == 0
        assert result["target"]["prompts"]["packages"]["held_out"] == ["stdlib:calendar", "stdlib:difflib"]
        assert "held_out_answers_equal_to_source" not in result["diversity"]  # no other writer to compare with
        assert [claim["claim"] for claim in result["claims"]] == [
            "regenerated > prompt lookup", "regenerated >= 1.5x prompt lookup", "rising with data, at every step",
            "train/serve within 10% per position, every chain", "dflash2 >= DFlash on the same states and verify block",
            "dspark >= DFlash on the same states and verify block"]
        assert "regenerated_over_source" not in result["goals"] and result["goals"]["asked"]["tau_at_least"] == 3.5
        assert result["goals"]["asked"]["over_prompt_lookup_at_least"] == 1.5
        assert [point["chain"] for point in result["data_curve"]] == ["regenerated-0.25", "regenerated"]
        assert (out.parent / result["data_curve_plot"]).is_file()
        # A second call on the same work directory finds every stage done and reads the same figures.
        again = bench.run("code-scale-tiny", workdir, prompts=tmp_path / "prompts")
        assert again["acceptance_length"] == result["acceptance_length"] and again["data"] == result["data"]
    finally:
        quality("launch").stop()


def test_a_cut_runs_figures_come_from_the_prompts_every_chain_decoded(quality, tmp_path):
    """cut_run.py on a run cut before its reports: each chain's tau over the prompts both decoded (the
    records as the evaluation keeps them), prompt lookup along greedy's output there, the last training line."""
    from dflash_jobs.evaluate.baselines import PromptLookupDrafter, along_greedy

    cut_run = quality("cut_run")
    prompt, greedy = [5, 6, 7, 5, 6], [7, 5, 6, 7, 9, 2]
    decoded = {"small": {0: [1, 0, 2], 1: [0, 0, 0, 0], 2: [3]}, "large": {0: [3, 1], 1: [2, 1]}}
    for chain, records in decoded.items():
        (tmp_path / chain).mkdir()
        (tmp_path / chain / "train-0.log").write_text(
            "2026-12-06 18:58:49,082 rank0 INFO step 10/20 epoch 0 | loss 2.9 acc@1 0.7 tau 3.16 | lr 5e-04 | 77026 tok/s, 40.8 TFLOP/s, MFU 4.1%, waiting for data 3% | eta 1m\n")
        kept = tmp_path / chain / "run" / "eval" / "prompts" / "0123456789abcdef"
        kept.mkdir(parents=True)
        for index, accepted in records.items():
            drafted = {"tokens": greedy, "seconds": 0.1, "accepted": accepted, "drafted": [3] * len(accepted)}
            (kept / f"{index:06d}.json").write_text(json.dumps({"index": index, "prompt": prompt, "result": {
                "greedy": {"tokens": greedy, "seconds": 0.1}, "drafted": {"dflash": drafted}, "simulated": [], "divergences": {"dflash": []},
                "verify_noise": [], "confidences": None, "trees": None}}))
    figures = cut_run.cut_figures(tmp_path, block=4, new_tokens=6, stop_ids=frozenset({2}))
    assert figures["prompts_decoded"] == {"large": 2, "small": 3} and figures["paired_prompts"] == 2
    assert figures["tau"]["small"]["estimate"] == round((3 + 3 + 0 + 4) / 7, 3)  # prompt 2 is not the other chain's
    assert figures["tau"]["large"]["estimate"] == round((4 + 2 + 3 + 2) / 4, 3)
    lookup = along_greedy(PromptLookupDrafter(4), prompt, greedy, max_new_tokens=6, stop_ids=frozenset({2}))
    assert figures["tau"]["prompt_lookup"]["estimate"] == round((sum(lookup.accepted) + len(lookup.accepted)) / len(lookup.accepted), 3)
    assert figures["training"]["small"] == {"step": 10, "steps": 20, "training_tau": 3.16, "tokens_per_s": 77026, "tflop_per_s": 40.8,
                                            "mfu_percent": 4.1}
    assert set(figures["differences"]) == {"small - large"} and figures["differences"]["small - large"]["verdict"] == "not decided"


def test_a_steps_interpreter_caches_its_bytecode_under_the_workdir_and_takes_one_thread_on_a_cpu(quality, tmp_path, monkeypatch):
    launch = quality("launch")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    cpu = launch.step_env(tmp_path, cpu=True)
    assert "PYTHONDONTWRITEBYTECODE" not in cpu and cpu["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    assert cpu["OMP_NUM_THREADS"] == "1" and cpu["PYTHONUNBUFFERED"] == "1" and cpu["PATH"] == os.environ["PATH"]
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")  # a prefix the caller set is kept
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gpu = launch.step_env(tmp_path, cpu=False)
    assert gpu["PYTHONPYCACHEPREFIX"] == "/elsewhere" and "OMP_NUM_THREADS" not in gpu
