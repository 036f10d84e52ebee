"""Keeps only the requested GPU architectures in causal-conv1d's setup.py.

causal-conv1d hard-codes one `-gencode` pair per architecture its nvcc knows (sm_75 ... sm_121 with
CUDA 13: nine of them), and torch's BuildExtension then ignores TORCH_CUDA_ARCH_LIST. Compiling all
nine takes longer than everything else in the image; we need two (Hopper sm_90, RTX PRO 6000 sm_120).

    python select_cuda_archs.py causal-conv1d/setup.py "9.0;12.0"

Dropped pairs become `pass` so the `if bare_metal_version >= ...:` blocks they sit in stay valid.
A requested architecture without a pair in the file is an error: after a version bump that changes
setup.py the build stops here instead of silently compiling the wrong set.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

GENCODE_PAIR = re.compile(
    r'^(?P<indent>[ \t]*)cc_flag\.append\("-gencode"\)\n'
    r'[ \t]*cc_flag\.append\("arch=compute_(?P<arch>\d+),code=sm_(?P=arch)"\)\n',
    re.MULTILINE,
)


def parse_arch_list(text: str) -> set[str]:
    """TORCH_CUDA_ARCH_LIST syntax ("9.0;12.0", also space-separated) as sm numbers {"90", "120"}."""
    archs = set()
    for item in re.split(r"[;\s]+", text.strip()):
        match = re.fullmatch(r"(\d+)\.(\d+)", item)
        if match is None:
            raise SystemExit(f"select_cuda_archs: {item!r} in {text!r} is not an architecture like 9.0 or 12.0")
        archs.add(f"{match.group(1)}{match.group(2)}")
    return archs


def select_archs(source: str, wanted: set[str]) -> str:
    found: set[str] = set()

    def keep_or_drop(match: re.Match[str]) -> str:
        found.add(match["arch"])
        return match.group(0) if match["arch"] in wanted else f"{match['indent']}pass\n"

    patched = GENCODE_PAIR.sub(keep_or_drop, source)
    missing = sorted(wanted - found, key=int)
    if missing:
        raise SystemExit(f"select_cuda_archs: no -gencode pair for sm_{', sm_'.join(missing)} "
                         f"(the file has sm_{', sm_'.join(sorted(found, key=int))}); update this script for the new setup.py")
    compile(patched, "setup.py", "exec")  # still valid Python
    return patched


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    path, arch_list = Path(argv[0]), argv[1]
    wanted = parse_arch_list(arch_list)
    path.write_text(select_archs(path.read_text(), wanted))
    print(f"select_cuda_archs: {path} builds sm_{', sm_'.join(sorted(wanted, key=int))} only")


if __name__ == "__main__":
    main(sys.argv[1:])
