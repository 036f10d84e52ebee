"""extract.compile: the target's norms and MLPs compiled, each on its own (regional compilation).

On the H200 the bf16 forward spends at least a quarter of its GPU time outside matmuls and the Gated
DeltaNet kernels (bench/results/extract-h200.json, profile): the RMSNorms' float32 round trips,
SwiGLU's activation and product, the gated norm of the Gated DeltaNet, each a few passes over
[tokens, hidden]. Compiled, each module becomes one or two fused kernels. The decoder layers
themselves are left alone: FLA's kernels and the packed attention run as they are, and the capture
hooks on the layers see the same outputs. dynamic=True: a graph per module class, input rank and
batch-size class serves every batch shape and width, so warm-up compiles a handful of graphs.
"""

from __future__ import annotations

import torch

RECOMPILE_LIMIT = 32


def compile_elementwise(decoder_layers: torch.nn.ModuleList, submodules: tuple[str, ...]) -> int:
    """Compiles each present module of `submodules` (its architecture's fused_submodules) of every layer
    in place; returns how many."""
    # One RMSNorm class serves the layer norms ([batch, tokens, hidden]) and the attention's head
    # norms (4-D strided views), each also specialised for batch 1 (packed rows) and more: about
    # eight graphs, dynamo's default limit, past which it would run the module eagerly unannounced.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = 0
    for layer in decoder_layers:
        for path in submodules:
            try:
                module = layer.get_submodule(path)
            except AttributeError:
                continue
            module.compile(dynamic=True)
            compiled += 1
    return compiled
