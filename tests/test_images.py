"""images/: static checks of the Dockerfiles (no Docker engine runs here) and of the arch selection
that keeps the causal-conv1d build to the GPUs we deploy on."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "images"
GPU_DOCKERFILE = IMAGES / "Dockerfile"
CONTROLLER_DOCKERFILE = IMAGES / "Dockerfile.controller"
DOCKERFILES = (GPU_DOCKERFILE, CONTROLLER_DOCKERFILE)
NON_ROOT_UID = "10001"

sys.path.insert(0, str(IMAGES))
from select_cuda_archs import parse_arch_list, select_archs  # noqa: E402


# ---- a small Dockerfile reader -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    args: str
    """With the build arguments' defaults substituted."""
    stage: int


def logical_lines(text: str) -> list[str]:
    """Joins continuation lines; comment lines vanish even inside a continuation, as in Docker."""
    lines, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
        else:
            lines.append(pending + line)
            pending = ""
    return lines


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with ARG defaults substituted: global ARGs for FROM, stage ARGs within a stage."""
    global_args: dict[str, str] = {}
    stage_args: dict[str, str] = {}
    stage = -1
    instructions = []
    for line in logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
            stage_args = {}
            rest = substitute(rest, global_args)
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            scope = global_args if stage < 0 else stage_args
            scope[name] = default.strip('"') if default else global_args.get(name, "")
        else:
            rest = substitute(rest, global_args | stage_args)
        instructions.append(Instruction(keyword, rest.strip(), stage))
    return instructions


def stages(path: Path) -> list[str]:
    return [i.args for i in parse_dockerfile(path) if i.keyword == "FROM"]


def final_stage(path: Path) -> list[Instruction]:
    instructions = parse_dockerfile(path)
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def arg_default(path: Path, name: str) -> str:
    return next(i.args.partition("=")[2].strip('"') for i in parse_dockerfile(path) if i.keyword == "ARG" and i.args.startswith(f"{name}="))


def env_values(instructions: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ENV":
            for token in shlex.split(instruction.args):
                name, _, value = token.partition("=")
                values[name] = substitute(value, values)
    return values


# ---- pip commands ------------------------------------------------------------------------------

OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-d", "--dest", "--target", "-t"}
PINNED = re.compile(r"^[A-Za-z0-9_.\-]+==\d[\w.+]*$")


@dataclass(frozen=True, slots=True)
class PipCommand:
    requirements: list[str]
    options: dict[str, str]
    flags: set[str]


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN line, split at &&, ||, ; and | outside quotes."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def pip_commands(path: Path) -> list[PipCommand]:
    commands = []
    for instruction in parse_dockerfile(path):
        if instruction.keyword != "RUN":
            continue
        for tokens in shell_commands(instruction.args):
            if "pip" not in tokens:
                continue
            tokens = tokens[tokens.index("pip") + 1:]
            if tokens[0] not in ("install", "download"):
                continue
            requirements, options, flags = [], {}, set()
            rest = iter(tokens[1:])
            for token in rest:
                if token in OPTIONS_WITH_VALUE:
                    options[token] = next(rest)
                elif token.startswith("-"):
                    flags.add(token.split("=")[0])
                else:
                    requirements.append(token)
            commands.append(PipCommand(requirements, options, flags))
    return commands


def constraints() -> dict[str, str]:
    pins = {}
    for line in logical_lines((IMAGES / "constraints.txt").read_text()):
        assert PINNED.match(line), f"constraints.txt: {line!r} is not name==version"
        name, _, version = line.partition("==")
        pins[canonical(name)] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- the tests ---------------------------------------------------------------------------------


def test_gpu_image_builds_on_cuda_13_0_cudnn_devel_and_runs_on_the_cudnn_runtime():
    builder, runtime = stages(GPU_DOCKERFILE)
    devel = re.fullmatch(r"nvidia/cuda:(13\.0\.\d+)-cudnn-devel-ubuntu(\d+\.\d+) AS builder", builder)
    run = re.fullmatch(r"nvidia/cuda:(13\.0\.\d+)-cudnn-runtime-ubuntu(\d+\.\d+) AS runtime", runtime)
    assert devel and run, (builder, runtime)
    # The virtual environment moves between stages: same CUDA, same OS (same Python path).
    assert devel.groups() == run.groups()


def test_controller_image_is_a_pinned_python_slim():
    builder, runtime = stages(CONTROLLER_DOCKERFILE)
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+ AS builder", builder), builder
    assert runtime.replace(" AS runtime", "") == builder.replace(" AS builder", "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_a_non_root_user(dockerfile):
    instructions = final_stage(dockerfile)
    users = [i.args for i in instructions if i.keyword == "USER"]
    assert users and users[-1] == f"{NON_ROOT_UID}:{NON_ROOT_UID}", users
    created = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert f"useradd --uid {NON_ROOT_UID} --gid {NON_ROOT_UID}" in created
    assert next(i for i in reversed(instructions) if i.keyword in ("USER", "RUN")).keyword == "USER", "nothing runs as root after USER"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned(dockerfile):
    pins = constraints()
    commands = pip_commands(dockerfile)
    assert commands
    for command in commands:
        constrained = "-c" in command.options
        if constrained:
            assert Path(command.options["-c"]).name == "constraints.txt"
        index = command.options.get("--index-url")
        assert index in (None, "https://download.pytorch.org/whl/cu130"), index
        for requirement in command.requirements:
            if requirement.startswith("/"):  # a local source tree: its dependencies are pinned or absent
                assert constrained or "--no-deps" in command.flags, f"{requirement}: dependencies unpinned"
            elif not PINNED.match(requirement):
                assert constrained and canonical(requirement) in pins, f"{requirement!r} is not pinned"


def test_every_dependency_of_the_package_is_pinned_for_the_gpu_image():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["jobs"] + project["optional-dependencies"]["gpu"]
    names = {canonical(re.match(r"[A-Za-z0-9_.\-]+", requirement).group()) for requirement in wanted}
    pinned_by_argument = {
        canonical(requirement.partition("==")[0])
        for command in pip_commands(GPU_DOCKERFILE) for requirement in command.requirements if PINNED.match(requirement)
    }
    unpinned = names - set(constraints()) - pinned_by_argument
    assert not unpinned, f"add to images/constraints.txt or pin by build argument: {sorted(unpinned)}"


def test_gpu_image_targets_hopper_and_blackwell_with_torch_for_cuda_13_0():
    assert parse_arch_list(arg_default(GPU_DOCKERFILE, "TORCH_CUDA_ARCH_LIST")) == {"90", "120"}
    assert arg_default(GPU_DOCKERFILE, "TORCH_INDEX_URL").endswith("/cu130")
    runs = [i.args for i in parse_dockerfile(GPU_DOCKERFILE) if i.keyword == "RUN"]
    build = next(run for run in runs if "select_cuda_archs.py" in run)
    assert '/build/causal-conv1d/setup.py "9.0;12.0"' in build and "--no-build-isolation" in build
    assert any('"/build/dflash-k8s[jobs,gpu]"' in run for run in runs)


def test_gpu_image_pins_a_triton_flash_linear_attention_trusts_on_hopper():
    """FLA refuses its gated backward on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results);
    the quality benchmark's target training and any GDN backward need one it trusts."""
    pinned = arg_default(GPU_DOCKERFILE, "TRITON_VERSION")
    assert tuple(int(part) for part in pinned.split(".")) >= (3, 7, 1)
    runs = [i.args for i in parse_dockerfile(GPU_DOCKERFILE) if i.keyword == "RUN"]  # build arguments expanded
    torch_run = next(run for run in runs if '"torch==' in run)
    assert f'"triton=={pinned}"' in torch_run  # right after torch, before anything compiles against it


def test_runtime_caches_live_under_the_users_writable_home():
    instructions = final_stage(GPU_DOCKERFILE)
    env = env_values(instructions)
    home = env["HOME"]
    assert f"--home-dir {home}" in " ".join(i.args for i in instructions if i.keyword == "RUN")
    for name in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[name].startswith(f"{home}/"), f"{name}={env[name]}"


SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_holds_no_credentials(dockerfile):
    instructions = parse_dockerfile(dockerfile)
    for instruction in instructions:
        if instruction.keyword in ("ENV", "ARG"):
            names = [token.partition("=")[0] for token in shlex.split(instruction.args)]
            assert not any(SECRET_NAME.search(name) for name in names), instruction.args
        if instruction.keyword in ("COPY", "ADD"):
            assert not re.search(r"\.env\b|\.aws|credentials|\.netrc|id_rsa", instruction.args), instruction.args
        assert not re.search(r"AKIA[0-9A-Z]{16}|hf_[A-Za-z0-9]{30,}", instruction.args)
    assert not any(i.keyword == "ADD" for i in instructions), "COPY only: ADD fetches URLs and unpacks archives"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_allows_exactly_what_the_dockerfile_copies(dockerfile):
    ignore = logical_lines(Path(f"{dockerfile}.dockerignore").read_text())
    assert ignore[0] == "*", "the context is an allowlist, so local state (.venv, .git, runs) never leaks in"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for instruction in parse_dockerfile(dockerfile):
        if instruction.keyword == "COPY" and not instruction.args.startswith("--from"):
            copied.update(shlex.split(instruction.args)[:-1])
    assert copied == allowed


# ---- select_cuda_archs ---------------------------------------------------------------------------

# The shape of causal-conv1d's setup.py: unconditional pairs, then pairs inside version checks.
SETUP_PY = '''
cc_flag = []
if True:
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_75,code=sm_75")
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_80,code=sm_80")
    if bare_metal_version >= Version("11.8"):
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_90,code=sm_90")
    if bare_metal_version >= Version("12.8"):
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_100,code=sm_100")
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_120,code=sm_120")
    if bare_metal_version >= Version("13.0"):
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_121,code=sm_121")
'''


def gencode_archs(source: str, bare_metal_version: float) -> list[str]:
    """Runs the setup.py fragment and returns the architectures it would compile."""
    namespace = {"bare_metal_version": bare_metal_version, "Version": float}
    exec(source, namespace)
    return re.findall(r"code=sm_(\d+)", " ".join(namespace["cc_flag"]))


def test_select_cuda_archs_keeps_only_the_requested_architectures():
    assert gencode_archs(SETUP_PY, 13.0) == ["75", "80", "90", "100", "120", "121"]
    patched = select_archs(SETUP_PY, parse_arch_list("9.0;12.0"))
    # The version checks whose pairs all went still parse (pass), and nvcc gets exactly two targets.
    assert gencode_archs(patched, 13.0) == ["90", "120"]
    assert gencode_archs(patched, 12.4) == ["90"]


def test_select_cuda_archs_refuses_an_architecture_the_file_does_not_build():
    with pytest.raises(SystemExit, match=r"no -gencode pair for sm_89 \(the file has sm_75, sm_80, sm_90, sm_100, sm_120, sm_121\)"):
        select_archs(SETUP_PY, {"89", "90"})
    with pytest.raises(SystemExit, match="'sm_90' .* is not an architecture like 9.0"):
        parse_arch_list("sm_90;12.0")


def test_select_cuda_archs_rewrites_the_file_in_place(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(SETUP_PY)
    result = subprocess.run([sys.executable, str(IMAGES / "select_cuda_archs.py"), str(setup), "9.0 12.0"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "builds sm_90, sm_120 only" in result.stdout
    assert gencode_archs(setup.read_text(), 13.0) == ["90", "120"]
