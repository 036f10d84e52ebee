"""How to serve a run's drafter with vLLM: the exact `vllm serve` command, from the exported config.json.

- What vLLM runs is chosen by the exported `architectures` (SERVED): the speculative method, the
  runner and the oldest vLLM that has it.
- `num_speculative_tokens` is the drafts per block of the drafter's anchor layout. vLLM never reads
  block_size, and the served block must be the trained one (reference/dflash2-dspark.md section 6,
  pitfall 2):
  - where the anchor is not a prediction slot (DFlash, DFlash2), block_size - 1: vLLM drafts the
    bonus token plus num_speculative_tokens masks per step (DFlash2's convolution even resets at
    1 + num_speculative_tokens);
  - DSpark (DeepSpec's Qwen3DSparkModel layout, `method: dspark`): block_size, the anchor being a
    prediction slot (sample_from_anchor, written in its config).
- `--attention-backend flash_attn` when a draft layer is bidirectional inside the block (full
  attention, or any layer under an explicit `is_causal: false`, which vLLM resolves first): vLLM
  refuses a backend without non-causal attention.
- `VLLM_USE_V2_MODEL_RUNNER=1` when sliding-window and full layers mix (vLLM needs two KV groups
  for the drafter, which only its V2 model runner has), and always for DFlash2, whose selector only
  the V2 runner has (V1 would draft it as DFlash, without a word), and DSpark, which only the V2
  runner serves (vLLM #46995; RedHat's Qwen3.8 DSpark card asks for vLLM >= 0.29).
- vLLM reads local directories: an s3:// drafter or target is synced to one first.

No torch here: `dflashctl status` formats the command in the control plane, the evaluation in its report.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from dflash_jobs.errors import FormatError
from dflash_jobs.formats import DRAFTER_CONFIG_KEY, DRAFTER_DIR
from dflash_jobs.spec import RunSpec, anchor_layout, is_s3


@dataclass(frozen=True, slots=True)
class ServedArchitecture:
    """How vLLM serves one exported architecture."""

    drafter: str
    """Its train.drafter, whose anchor layout gives the drafts per block."""
    method: str
    """--speculative-config's method."""
    v2_runner: bool = False
    """Needs vLLM's V2 model runner whatever its layers."""
    min_vllm: str | None = None
    """The first vLLM release that serves it, when newer than DFlash's."""


SERVED = {
    "DFlashDraftModel": ServedArchitecture("dflash", method="dflash"),
    "DFlash2DraftModel": ServedArchitecture("dflash2", method="dflash", v2_runner=True, min_vllm="0.28.0"),
    "Qwen3DSparkModel": ServedArchitecture("dspark", method="dspark", v2_runner=True),
}
"""Exported `architectures` -> how vLLM serves it (reference/dflash2-dspark.md 3.7, 4.7)."""


def served_architecture(exported: Mapping[str, Any]) -> ServedArchitecture:
    names = exported.get("architectures") or []
    for name in names:
        if name in SERVED:
            return SERVED[name]
    raise FormatError(f"{DRAFTER_CONFIG_KEY} names architectures {names}, none of which this version serves ({', '.join(SERVED)})",
                      "Export the drafter again (`dflashctl submit train`)")


def speculative_config(drafter: str, exported: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's --speculative-config for the drafter at `drafter` whose config.json is `exported`."""
    served = served_architecture(exported)
    drafts = anchor_layout(served.drafter, block_size=_block_size(exported)).drafts
    return {"method": served.method, "model": drafter, "num_speculative_tokens": drafts}


def vllm_serve_command(*, target: str, drafter: str, exported: Mapping[str, Any], endpoint_url: str | None = None) -> str:
    """The shell commands that serve `target` with the drafter at `drafter` (local paths or s3:// URLs)."""
    served = served_architecture(exported)
    layer_types = exported.get("layer_types") or ["full_attention"] * int(exported.get("num_hidden_layers", 1))
    is_causal = exported.get("is_causal")
    bidirectional = any(kind != "sliding_attention" if is_causal is None else not is_causal for kind in layer_types)
    lines = [f"# a {served.drafter} drafter needs vLLM >= {served.min_vllm}"] if served.min_vllm else []
    local = {}
    for url in (drafter, target):
        local[url] = _local_path(url)
        if is_s3(url):
            endpoint = f" --endpoint-url {shlex.quote(endpoint_url)}" if endpoint_url else ""
            lines.append(f"aws s3 sync{endpoint} {shlex.quote(url.rstrip('/'))} {shlex.quote(local[url])}")
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if served.v2_runner or len(set(layer_types)) > 1 else ""
    config = json.dumps(speculative_config(local[drafter], exported))
    serve = f"{env}vllm serve {shlex.quote(local[target])} \\\n  --speculative-config {shlex.quote(config)}"
    if bidirectional:
        serve += " \\\n  --attention-backend flash_attn"
    return "\n".join([*lines, serve])


def run_serve_command(spec: RunSpec, exported: Mapping[str, Any]) -> str:
    """The serve command of a run's exported drafter (<output>/train/drafter) with its target."""
    drafter = f"{spec.output.rstrip('/')}/{DRAFTER_DIR}"
    return vllm_serve_command(target=spec.target.model, drafter=drafter, exported=exported, endpoint_url=spec.storage.endpoint_url)


def _block_size(exported: Mapping[str, Any]) -> int:
    block_size = exported.get("block_size") or (exported.get("dflash_config") or {}).get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise FormatError(f"{DRAFTER_CONFIG_KEY} has no block_size >= 2 ({block_size!r})", "Export the drafter again (`dflashctl submit train`)")
    return block_size


def _local_path(url: str) -> str:
    """Where vLLM reads a location: a local path as given, an s3:// prefix synced under its last name."""
    if is_s3(url):
        return "./" + url.rstrip("/").rsplit("/", 1)[-1]
    return url.removeprefix("file://")
