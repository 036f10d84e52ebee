"""A GGUF file as a Hugging Face checkpoint directory: what every step of a run reads as its target.

GGUF (llama.cpp's format) holds quantized weights, the tokenizer and the chat template in one file.
Transformers reads it (`gguf_file=`, with the `gguf` package) and dequantizes every tensor, but
refuses to `save_pretrained` a model it loaded that way; this writes the dequantized weights as
safetensors beside a config.json without the quantization entry, the tokenizer (with its chat
template) and the generation config. The weights are the quantized ones made dense: a 4-bit file
gives the answers of its 4-bit model, not of the original.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from dflash_jobs.errors import InputError

log = logging.getLogger("dflash.gguf")

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """A file that starts as GGUF files do."""
    try:
        with path.open("rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def convert_gguf(gguf: Path, directory: Path, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """Writes the checkpoint of `gguf` into `directory` (created; files already there of the same
    names are replaced) with its weights in `dtype`; returns what it wrote."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise InputError(f"GGUF file {gguf} does not exist", "Give the path of a .gguf file")
    if not is_gguf(gguf):
        raise InputError(f"{gguf} is not a GGUF file (it does not start with {GGUF_MAGIC!r})", "Give a llama.cpp .gguf file")
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Dequantized in float32, as transformers' GGUF kernels compute, then cast once.
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).to(getattr(torch, dtype))
    except ImportError as exc:
        raise InputError(f"reading GGUF file {gguf} needs the gguf package ({exc})", "pip install gguf") from None
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise InputError(
            f"transformers cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}",
            "Use a GGUF file of an architecture and quantization transformers dequantizes "
            "(https://huggingface.co/docs/transformers/gguf), or convert the model to a safetensors checkpoint",
        ) from None
    if not tokenizer.chat_template:
        raise InputError(f"GGUF file {gguf} holds no chat template", "Use an instruction-tuned model's GGUF file, which carries its template")
    # The quantizer is what refuses to save; the weights are already dense in `dtype`.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.name_or_path = gguf.name
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    written = {
        "gguf": str(gguf),
        "model_type": config.get("model_type"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings")),
        "files": sorted(path.name for path in directory.iterdir()),
        "seconds": round(time.monotonic() - started, 1),
    }
    log.info("GGUF %s -> %s: %s, %d parameters in %s", gguf, directory, written["model_type"], written["parameters"], dtype)
    return written
