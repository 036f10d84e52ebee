#!/usr/bin/env bash
# Builds a causal-conv1d wheel on a GPU machine that reaches no package registry (the H200 we
# benchmark on), against that machine's own torch, for the named architectures only.
#
#     bash bench/causal_conv1d_wheel.sh SDIST ARCHS OUTDIR
#     bash bench/causal_conv1d_wheel.sh .whl/causal_conv1d-1.7.0.tar.gz "9.0" "$OUT"
#
# Without causal-conv1d, transformers runs the Gated DeltaNet's short convolution through a torch
# fallback: the extraction forward on the H200 runs 1.13x faster with causal-conv1d
# (bench/results/extract-h200.json against extract-h200-torch-conv.json). causal-conv1d ships only a
# source distribution, which compiles one `-gencode` pair per architecture nvcc knows: nine with
# CUDA 13, more than one 10-minute call. The image keeps two
# (images/select_cuda_archs.py, as images/Dockerfile does); a benchmark machine needs one.
#
# Fetch the source distribution where a registry is reachable, without compiling, from an environment
# with torch, setuptools and wheel (its setup.py runs to read the metadata):
#     CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-binary=causal-conv1d \
#         --no-build-isolation -d .whl causal-conv1d==1.7.0
# Measured on the H200 machine (16 cores, MAX_JOBS=4: one job per source file; nvcc 13.0, torch
# 2.11.0+cu130, Python 3.12, sm_90 only): 265 s, a 26 MB wheel; 607 s on 2 cores. The wheel lands
# in OUTDIR: install it in the same call (`pip install --no-deps --target .site`), or split it under
# the device tool's 16 MiB per returned file to carry it in later calls. The build needs no GPU, so
# it can run in the background (setsid) while a call uses the GPU for something else.
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
