"""Pre-flight check of a pod: `python -m dflash_jobs.selfcheck -f SPEC --component extract`.

Every rendered Job runs it first, as the initContainer "selfcheck" (the local backend runs the same
one). A pod on a node whose driver is too old for CUDA 13, an image without the fast paths,
unreachable storage or a wrong checkpoint path then fails within seconds, with a message that names
what is missing and how to fix it, instead of after minutes of model loading or hours into a run.

It prints one line per check and a one-line summary, and exits EXIT_BAD_SPEC (2) when a check
fails: every pod of the Job would fail the same way, so the rendered podFailurePolicy fails the Job.
On the local backend with `local.device: cpu` the GPU checks are reported as skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from dflash_jobs.errors import EXIT_BAD_SPEC, EXIT_OK, DflashError, SpecError, StorageError
from dflash_jobs.formats import RUN_KEY
from dflash_jobs.spec import DEFAULT_SPEC_FILE, GenerateSpec, RunSpec, is_s3, load_spec, resolve_layers, text_config
from dflash_jobs.storage import ObjectNotFound, open_storage, open_url, storage_for
from dflash_jobs.termination import write_termination_message

COMPONENTS = ("generate", "prepare", "extract", "train", "eval")
Component = Literal["generate", "prepare", "extract", "train", "eval"]
Status = Literal["ok", "warn", "skip", "fail"]

MIN_DRIVER_CUDA = (13, 0)
# The oldest Linux driver of CUDA 13.0 GA (CUDA 13.0 release notes, "CUDA Driver" table).
MIN_DRIVER_VERSION = (580, 65, 6)
MIN_DRIVER_TEXT = "580.65.06"
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
KERNEL_DRIVER_FILE = Path("/proc/driver/nvidia/version")
IMAGE_FIX = "Run the dflash CUDA image (images/Dockerfile), which installs the package with .[jobs,gpu]"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.name:<22} {self.status:<4}  {self.detail}"
        return f"{text}. {self.fix}" if self.fix and self.status in ("fail", "warn") else text


@dataclass(frozen=True, slots=True)
class FastPath:
    """A kernel package transformers picks up by importing `module.function` (else: a slower torch path)."""

    package: str
    module: str
    function: str


# The symbols transformers' Qwen3.5/3.6 modeling imports (integrations/hub_kernels.py); an import
# error there silently selects the torch fallback, 1.5x slower for the Gated DeltaNet.
FLA = FastPath("flash-linear-attention", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
CAUSAL_CONV1D = FastPath("causal-conv1d", "causal_conv1d", "causal_conv1d_fn")


@dataclass(frozen=True, slots=True)
class Needs:
    """What one component needs from its pod."""

    gpus: int
    fla_missing: Status
    """How a missing flash-linear-attention counts on a GPU: "fail" where the target's speed matters."""
    weights: bool
    tokenizer: bool
    reads_source: bool
    packages: tuple[str, ...] = ("torch", "transformers", "safetensors")


def component_needs(spec: RunSpec, component: Component) -> Needs:
    if component == "generate":
        settings = spec.generate or GenerateSpec()
        if settings.engine == "vllm":
            # The vLLM image brings its own kernels: this image's fast paths do not run there.
            return Needs(gpus=settings.gpus_per_shard, fla_missing="skip", weights=True, tokenizer=True, reads_source=True)
        return Needs(gpus=1, fla_missing="warn", weights=True, tokenizer=True, reads_source=True)
    if component == "prepare":
        return Needs(gpus=0, fla_missing="skip", weights=False, tokenizer=True, reads_source=True, packages=("transformers",))
    if component == "extract":
        return Needs(gpus=1, fla_missing="fail", weights=True, tokenizer=False, reads_source=False)
    if component == "train":
        # Stored states: the drafter reads only the target's embedding and head, no Gated DeltaNet runs in
        # training. Online: every rank runs the target as an extract pod does.
        online = spec.train.states == "online"
        return Needs(gpus=spec.train.gpus_per_node, fla_missing="fail" if online else "skip", weights=True, tokenizer=False, reads_source=False)
    return Needs(gpus=1, fla_missing="warn", weights=True, tokenizer=True, reads_source=False)


# ---- GPU, driver and torch build ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuReport:
    """What the pod sees of its GPUs, gathered by `probe_gpu` (plain data, so the rules are testable)."""

    torch_version: str | None = None
    torch_cuda: str | None = None
    """torch.version.cuda: the CUDA version torch was built for (None: a CPU-only build)."""
    arch_list: tuple[str, ...] = ()
    driver_cuda: tuple[int, int] | None = None
    """The newest CUDA version the installed driver supports (cuDriverGetVersion)."""
    kernel_driver: str | None = None
    """The NVIDIA kernel module version from /proc/driver/nvidia/version, e.g. 580.95.05."""
    devices: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(name, compute capability) of every visible GPU."""
    error: str | None = None
    """Why torch or CUDA could not be used, if so."""


def read_kernel_driver(path: Path = KERNEL_DRIVER_FILE) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def read_driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA version the loaded driver supports (cuDriverGetVersion), None without a driver.

    Asked of libcuda directly: torch has no public call for it, and when the driver is too old
    torch only reports that CUDA is unavailable."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value == 0:
        return None
    return version.value // 1000, version.value % 1000 // 10


def probe_gpu() -> GpuReport:
    kernel_driver = read_kernel_driver()
    driver_cuda = read_driver_cuda()
    try:
        import torch
    except ImportError as exc:
        return GpuReport(kernel_driver=kernel_driver, driver_cuda=driver_cuda, error=f"cannot import torch ({exc})")
    base = dict(torch_version=torch.__version__, torch_cuda=torch.version.cuda, kernel_driver=kernel_driver, driver_cuda=driver_cuda)
    if torch.version.cuda is None:
        return GpuReport(**base)
    try:
        devices = tuple(
            (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())
        )
    except RuntimeError as exc:  # CUDA initialisation failed: no device node, driver too old, ...
        return GpuReport(**base, error=str(exc).splitlines()[0])
    return GpuReport(**base, arch_list=tuple(torch.cuda.get_arch_list()), devices=devices)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _arch_supported(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """A native cubin for this GPU, or PTX of an older architecture that the driver can JIT."""
    number = capability[0] * 10 + capability[1]
    return f"sm_{number}" in arch_list or any(
        arch.startswith("compute_") and int(arch.removeprefix("compute_")) <= number for arch in arch_list
    )


def check_gpu(report: GpuReport, needed: int, component: Component) -> list[Check]:
    """torch build, driver and devices, in the order a failure should be read."""
    if report.torch_version is None:
        return [Check("torch", "fail", report.error or "torch is not installed", IMAGE_FIX)]
    if report.torch_cuda is None:
        return [Check("torch", "fail", f"torch {report.torch_version} is a CPU-only build",
                      f"{IMAGE_FIX} (torch from the cu130 index); on a laptop set local.device: cpu")]
    if _version_tuple(report.torch_cuda)[:1] < MIN_DRIVER_CUDA[:1]:
        return [Check("torch", "fail", f"torch {report.torch_version} is built for CUDA {report.torch_cuda}, not 13",
                      "Rebuild the image with TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 (images/README.md)")]
    checks = [Check("torch", "ok", f"torch {report.torch_version}, CUDA {report.torch_cuda}")]

    driver = f"driver {report.kernel_driver or 'unknown'}"
    driver_fix = (f"CUDA 13.0 needs NVIDIA driver >= {MIN_DRIVER_TEXT}: upgrade the node's driver (GPU Operator "
                  "driver.version) or select newer nodes with cluster.node_selector")
    if report.driver_cuda is not None and report.driver_cuda < MIN_DRIVER_CUDA:
        return [*checks, Check("driver", "fail", f"{driver} supports CUDA up to {report.driver_cuda[0]}.{report.driver_cuda[1]}", driver_fix)]
    if report.kernel_driver is not None and _version_tuple(report.kernel_driver) < MIN_DRIVER_VERSION:
        return [*checks, Check("driver", "fail", f"{driver} is older than {MIN_DRIVER_TEXT}", driver_fix)]
    if report.driver_cuda is None and report.kernel_driver is None:
        return [*checks, Check("driver", "fail", "no NVIDIA driver is visible in this container",
                               f"The pod must request nvidia.com/gpu: {needed} on a node with the NVIDIA container toolkit "
                               "(GPU Operator); check the GPU toleration and cluster.node_selector")]
    cuda = f", CUDA {report.driver_cuda[0]}.{report.driver_cuda[1]}" if report.driver_cuda else ""
    checks.append(Check("driver", "ok", f"{driver}{cuda}"))

    if report.error is not None:
        return [*checks, Check("gpu", "fail", f"CUDA cannot initialise: {report.error}",
                               "Check `nvidia-smi` on the node and the device plugin's health")]
    if len(report.devices) < needed:
        return [*checks, Check("gpu", "fail", f"{len(report.devices)} GPU(s) visible, {component} needs {needed}",
                               f"Request nvidia.com/gpu: {needed} in the pod (the rendered Jobs do) and do not narrow "
                               "CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES")]
    unsupported = sorted({cap for _, cap in report.devices if not _arch_supported(cap, report.arch_list)})
    if unsupported:
        archs = ", ".join(f"sm_{major}{minor}" for major, minor in unsupported)
        return [*checks, Check("gpu", "fail", f"torch has no kernels for {archs} (built for {', '.join(report.arch_list)})",
                               "Use a torch build that covers this GPU, or run on GPUs it supports")]
    name, (major, minor) = report.devices[0]
    return [*checks, Check("gpu", "ok", f"{len(report.devices)} x {name} (sm_{major}{minor}), {needed} needed")]


# ---- fast paths --------------------------------------------------------------------------------


def check_fast_path(path: FastPath, missing: Status) -> Check:
    try:
        module = importlib.import_module(path.module)
        getattr(module, path.function)
    except Exception as exc:  # a broken build fails at import with any error, not only ImportError
        fix = f"{IMAGE_FIX}; without it transformers falls back to a slower torch implementation"
        return Check(path.package, missing, f"cannot import {path.module}.{path.function} ({type(exc).__name__}: {exc})", fix)
    version = getattr(importlib.import_module(path.module.split(".")[0]), "__version__", "?")
    return Check(path.package, "ok", f"{path.module}.{path.function} ({version})")


def check_packages(packages: tuple[str, ...]) -> Check:
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        return Check("packages", "fail", f"{', '.join(missing)} not installed",
                     "Install the data-plane extra: pip install 'dflash-k8s[jobs]' (the image has it)")
    return Check("packages", "ok", ", ".join(packages))


# ---- storage and inputs ------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(spec: RunSpec) -> Check:
    """The output root answers a listing (S3) or is a writable directory (local)."""
    if is_s3(spec.output):
        empty = [name for name in CREDENTIAL_VARS if os.environ.get(name) == ""]
        if empty:
            return Check("output", "fail", f"{' and '.join(empty)} set but empty",
                         f"Fill the Secret {spec.cluster.s3_secret!r} (k8s/components/s3-secret/ is a template without values)")
    else:
        directory = Path(spec.output.removeprefix("file://"))
        existing = _nearest_existing(directory.absolute())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            return Check("output", "fail", f"{directory} cannot be created: {existing} is not a writable directory",
                         "Point output at a writable directory, or at s3://bucket/prefix")
    try:
        storage = storage_for(spec)
        found = storage.list(RUN_KEY)
    except StorageError as exc:
        return Check("output", "fail", f"output {spec.output} is unreachable: {exc.what}", exc.fix)
    return Check("output", "ok", f"{storage.url} reachable ({RUN_KEY} {'present' if found else 'not yet written'})")


def check_source(spec: RunSpec) -> Check:
    storage_kw = dict(endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    try:
        storage, key = open_url(spec.data.source.removeprefix("file://"), **storage_kw)
        info = storage.stat(key)
    except StorageError as exc:
        return Check("data.source", "fail", f"{spec.data.source} is unreachable: {exc.what}", exc.fix)
    if info is None:
        return Check("data.source", "fail", f"{spec.data.source} does not exist", "Fix data.source or upload the JSONL there")
    return Check("data.source", "ok", f"{spec.data.source} ({info.size} bytes)")


def check_target(spec: RunSpec, needs: Needs) -> Check:
    """config.json parses, the captured layers fit its depth, and the files this component loads exist."""
    model = spec.target.model
    fix = "Point target.model at a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)"
    if spec.cluster.model_volume is not None and spec.backend == "kubernetes":
        fix += f"; in pods the PVC {spec.cluster.model_volume.claim!r} is mounted at {spec.cluster.model_volume.mount}"
    try:
        storage = open_storage(model.removeprefix("file://"), endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
        config = json.loads(storage.get_bytes("config.json"))
        files = [key for key in storage.list("") if "/" not in key]
    except ObjectNotFound:
        return Check("target", "fail", f"target.model {model} has no config.json", fix)
    except StorageError as exc:
        return Check("target", "fail", f"target.model {model} is unreachable: {exc.what}", exc.fix)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Check("target", "fail", f"{model}/config.json is not valid JSON ({exc})", fix)
    try:
        layers = resolve_layers(spec, config)
    except SpecError as exc:
        return Check("target", "fail", exc.what, exc.fix)
    wanted = {"weights (*.safetensors)": needs.weights, "tokenizer (tokenizer_config.json)": needs.tokenizer}
    present = {
        "weights (*.safetensors)": any(key.endswith(".safetensors") for key in files),
        "tokenizer (tokenizer_config.json)": "tokenizer_config.json" in files,
    }
    missing = [what for what, needed in wanted.items() if needed and not present[what]]
    if missing:
        return Check("target", "fail", f"target.model {model} has no {' and no '.join(missing)}", fix)
    from dflash_jobs.architectures import model_type

    return Check("target", "ok", f"{model}: {model_type(config)}, {text_config(config)['num_hidden_layers']} layers, capturing {layers}")


def gated_deltanet(spec: RunSpec) -> bool | None:
    """Whether the target's architecture has Gated DeltaNet layers, whose fast path is
    flash-linear-attention (architectures/); None where its config cannot be read (check_target says why)."""
    from dflash_jobs.architectures import target_architecture

    try:
        config = json.loads(open_storage(spec.target.model.removeprefix("file://"), endpoint_url=spec.storage.endpoint_url,
                                         region=spec.storage.region).get_bytes("config.json"))
    except (StorageError, ValueError):
        return None
    return target_architecture(config).gated_deltanet


# ---- wiring ------------------------------------------------------------------------------------


@dataclass(slots=True)
class SelfCheck:
    spec: RunSpec
    component: Component
    probe: Callable[[], GpuReport] = probe_gpu
    checks: list[Check] = field(default_factory=list)

    @property
    def cpu_mode(self) -> bool:
        return self.spec.backend == "local" and self.spec.local.device == "cpu"

    def run(self) -> list[Check]:
        needs = component_needs(self.spec, self.component)
        checks = [check_packages(needs.packages)]
        if needs.gpus == 0 or self.cpu_mode:
            why = "cpu mode: local.device is cpu" if self.cpu_mode else f"{self.component} runs on CPU"
            checks += [Check(name, "skip", why) for name in ("gpu", FLA.package, CAUSAL_CONV1D.package)]
        else:
            checks += check_gpu(self.probe(), needs.gpus, self.component)
            if needs.fla_missing != "skip" and gated_deltanet(self.spec) is False:
                checks += [Check(path.package, "skip", "the target has no Gated DeltaNet layers") for path in (FLA, CAUSAL_CONV1D)]
            else:
                checks += [check_fast_path(FLA, needs.fla_missing), check_fast_path(CAUSAL_CONV1D, "warn")]
        checks.append(check_output(self.spec))
        if needs.reads_source:
            checks.append(check_source(self.spec))
        checks.append(check_target(self.spec, needs))
        self.checks = checks
        return checks

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if check.status == "fail"]

    def summary(self) -> str:
        if self.failures:
            first = self.failures[0]
            more = f" (+{len(self.failures) - 1} more above)" if len(self.failures) > 1 else ""
            return f"selfcheck {self.component}: FAILED {first.name}: {first.detail}. {first.fix}{more}"
        statuses = ", ".join(f"{check.name} {check.status}" for check in self.checks)
        return f"selfcheck {self.component}: passed ({statuses})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_jobs.selfcheck",
        description="Check that this pod can run a dflash component: GPUs, driver, fast paths, storage, checkpoint.",
    )
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--component", required=True, choices=COMPONENTS)
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.file)
    except DflashError as exc:
        print(f"selfcheck {args.component}: FAILED spec: {exc}", flush=True)
        return EXIT_BAD_SPEC
    selfcheck = SelfCheck(spec, args.component)
    for check in selfcheck.run():
        print(f"selfcheck {args.component}: {check.line()}", flush=True)
    summary = selfcheck.summary()
    print(summary, flush=True)
    if selfcheck.failures:
        write_termination_message(summary)
        return EXIT_BAD_SPEC
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
