"""FP8 compute for the target's linear layers (extract.compute_dtype: float8), for users who serve
the target in FP8 and want the states it really produces there, at about twice the matmul rate.

Row-wise scaling, as FP8 serving does: every weight row (output channel) gets a float32 scale set
once from its absolute maximum, every activation row (token) a scale computed on the fly; the
product runs on the FP8 tensor cores through torch._scaled_mm with bf16 output. Norms, the Gated
DeltaNet recurrence, attention and the embedding stay in bf16. Needs compute capability 8.9 or
newer (Ada, Hopper, Blackwell); anything else is refused before the model loads.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_jobs.errors import SpecError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_CAPABILITY = (8, 9)
MIN_FEATURES = 128
"""Narrower projections (the Gated DeltaNet's a/b gates) stay in bf16: too small to gain."""


def require_fp8(device: torch.device) -> None:
    """Refuses float8 compute where no FP8 tensor core (or no row-wise scaled matmul) exists."""
    field = "extract.compute_dtype"
    if device.type != "cuda":
        raise SpecError(field, "float8", f"bfloat16 on {device} (FP8 compute needs a GPU with FP8 tensor cores: compute capability 8.9+)")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise SpecError(field, "float8", f"bfloat16 on {name} (compute capability {capability[0]}.{capability[1]}; FP8 tensor cores need 8.9+: Ada, Hopper, Blackwell)")
    try:  # the build of torch must also have the row-wise kernel for this architecture
        probe = Float8Linear.from_linear(nn.Linear(256, 256, bias=False, device=device, dtype=torch.bfloat16))
        probe(torch.randn(32, 256, device=device, dtype=torch.bfloat16))
    except RuntimeError as exc:
        raise SpecError(field, "float8", f"bfloat16: this torch cannot run row-wise FP8 matmuls here ({str(exc).splitlines()[0]})") from None


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / FP8_MAX
    # bf16 arithmetic for the division: a float32 copy of a [tokens, 17408] input would cost GBs.
    quantized = (x * (1.0 / scale).to(x.dtype)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale


_fused_quantize_rows = None
"""_quantize_rows compiled for the GPU: one reduction and one fused cast instead of eight passes
over the activation (eager, they cost about as much as the FP8 matmul they feed: bench/results/
extract-fp8-h200.json measured 1.13x the bf16 forward that way)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> (FP8 [rows, k], float32 scale [rows, 1]) with x ~= q * scale per row."""
    global _fused_quantize_rows
    if not x.is_cuda:
        return _quantize_rows(x)
    if _fused_quantize_rows is None:
        _fused_quantize_rows = torch.compile(_quantize_rows, dynamic=True)
    return _fused_quantize_rows(x)


class Float8Linear(nn.Module):
    """y = x @ W.T (+ b) with W and x in FP8, row-wise scaled, accumulated and returned in bf16."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # FP8 [out, in]
        self.register_buffer("weight_scale", weight_scale)  # float32 [1, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.out_dtype = out_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        weight, scale = quantize_rows(linear.weight.detach())
        return cls(weight, scale.reshape(1, -1), None if linear.bias is None else linear.bias.detach(), linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale = quantize_rows(rows)
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=self.out_dtype)
        if self.bias is not None:  # added apart: not every build fuses a bias into row-wise scaled matmuls
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 row-wise"


def eligible(linear: nn.Linear, min_features: int = MIN_FEATURES) -> bool:
    """_scaled_mm wants both dimensions in multiples of 16."""
    out, inp = linear.weight.shape
    return min(out, inp) >= min_features and out % 16 == 0 and inp % 16 == 0


def to_float8(layers: nn.ModuleList, *, min_features: int = MIN_FEATURES) -> int:
    """Swaps every eligible nn.Linear of the decoder layers for a Float8Linear, one at a time (the
    bf16 weight is freed as its FP8 copy appears: no second copy of the model); returns how many."""
    swapped = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and eligible(child, min_features):
                    setattr(parent, name, Float8Linear.from_linear(child))
                    swapped += 1
    return swapped
