"""How to serve a run's drafter with vLLM: the exact `vllm serve` command, from the exported config.json.

- Each exported architecture has its row in SERVING: the speculative method, how many tokens a
  block drafts (vLLM's num_speculative_tokens; vLLM never reads block_size) and whether only vLLM's
  V2 model runner serves it.
  - DFlashDraftModel (z-lab): `method: dflash`, num_speculative_tokens = block_size - 1: vLLM
    drafts the bonus token plus num_speculative_tokens masks per step, so a drafter trained on
    blocks of B serves B - 1.
  - Qwen3DSparkModel (DeepSpec's layout): `method: dspark`, num_speculative_tokens = block_size:
    the anchor is a prediction slot (sample_from_anchor, written in the config), and the served
    block must be the trained one (reference/dflash2-dspark.md section 6, pitfall 2). vLLM runs
    DSpark in its V2 model runner only, and has it since #46995 (2026-06; RedHat's Qwen3.8 DSpark
    card asks for vLLM >= 0.29).
- `--attention-backend flash_attn` when a draft layer is full attention: those layers are
  bidirectional inside the block, and vLLM refuses a backend without non-causal attention.
- `VLLM_USE_V2_MODEL_RUNNER=1` when sliding-window and full layers mix (vLLM needs two KV groups
  for the drafter, which only its V2 model runner has), or when the architecture needs that runner.
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
from dflash_jobs.spec import RunSpec, is_s3


@dataclass(frozen=True, slots=True)
class Serving:
    """How vLLM serves one exported architecture."""

    method: str
    """--speculative-config's method."""
    drafts_from_anchor: bool
    """The anchor is a prediction slot: a block drafts block_size tokens, else block_size - 1."""
    v2_runner: bool
    """Only vLLM's V2 model runner serves it (VLLM_USE_V2_MODEL_RUNNER=1 whatever the layers)."""


SERVING = {
    "DFlashDraftModel": Serving(method="dflash", drafts_from_anchor=False, v2_runner=False),
    "Qwen3DSparkModel": Serving(method="dspark", drafts_from_anchor=True, v2_runner=True),
}
"""Keyed by the exported config.json's architectures[0]."""


def serving_of(exported: Mapping[str, Any]) -> Serving:
    """The SERVING row of an exported config.json."""
    architecture = (exported.get("architectures") or [None])[0]
    if architecture not in SERVING:
        raise FormatError(f"{DRAFTER_CONFIG_KEY} names architecture {architecture!r}, which has no vLLM serving entry here (known: {', '.join(SERVING)})",
                          "Export the drafter again (`dflashctl submit train`)")
    return SERVING[architecture]


def speculative_config(drafter: str, exported: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's --speculative-config for the drafter at `drafter` whose config.json is `exported`."""
    serving = serving_of(exported)
    block_size = _block_size(exported)
    return {"method": serving.method, "model": drafter, "num_speculative_tokens": block_size if serving.drafts_from_anchor else block_size - 1}


def vllm_serve_command(*, target: str, drafter: str, exported: Mapping[str, Any], endpoint_url: str | None = None) -> str:
    """The shell commands that serve `target` with the drafter at `drafter` (local paths or s3:// URLs)."""
    layer_types = exported.get("layer_types") or ["full_attention"] * int(exported.get("num_hidden_layers", 1))
    lines = []
    local = {}
    for url in (drafter, target):
        local[url] = _local_path(url)
        if is_s3(url):
            endpoint = f" --endpoint-url {shlex.quote(endpoint_url)}" if endpoint_url else ""
            lines.append(f"aws s3 sync{endpoint} {shlex.quote(url.rstrip('/'))} {shlex.quote(local[url])}")
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if len(set(layer_types)) > 1 or serving_of(exported).v2_runner else ""
    config = json.dumps(speculative_config(local[drafter], exported))
    serve = f"{env}vllm serve {shlex.quote(local[target])} \\\n  --speculative-config {shlex.quote(config)}"
    if "full_attention" in layer_types:
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
