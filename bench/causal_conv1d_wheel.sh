#!/usr/bin/env bash
# Builds a causal-conv1d wheel on a GPU machine that reaches no package registry (the H200 we
# benchmark on), against that machine's own torch, for the named architectures only.
#
#     bash bench/causal_conv1d_wheel.sh SDIST ARCHS OUTDIR
#     bash bench/causal_conv1d_wheel.sh .whl/causal_conv1d-1.7.0.tar.gz "9.0" "$OUT"
#
# Without causal-conv1d, transformers runs the Gated DeltaNet's short convolution through a torch
# fallback: 7% of the extraction forward's GPU time on the H200 (bench/results/extract-h200.json,
# profile). causal-conv1d ships only a source distribution, which compiles one `-gencode` pair per
# architecture nvcc knows: nine with CUDA 13, more than one 10-minute call. The image keeps two
# (images/select_cuda_archs.py, as images/Dockerfile does); a benchmark machine needs one.
#
# Fetch the source distribution where a registry is reachable, without compiling:
#     CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-binary=causal-conv1d \
#         --no-build-isolation -d .whl causal-conv1d==1.7.0
# Measured here (2 CPU cores, nvcc 13.0, torch 2.11.0+cu130, sm_90 only): 607 s, a 25 MB wheel. The
# wheel lands in OUTDIR: install it in the same call (`pip install --no-deps --target .site`), or
# split it under the device tool's 16 MiB per returned file to carry it in later calls.
set -euo pipefail

sdist=$1 archs=$2 outdir=$3
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/src" "$outdir"
tar -xzf "$sdist" -C "$work/src" --strip-components=1
python3 "$here/images/select_cuda_archs.py" "$work/src/setup.py" "$archs"
started=$(date +%s)
CAUSAL_CONV1D_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST="$archs" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$outdir" "$work/src"
echo "causal-conv1d built for $archs in $(( $(date +%s) - started )) s: $(ls "$outdir"/causal_conv1d-*.whl)"
