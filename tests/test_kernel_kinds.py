"""bench/kernel_kinds.py: a profiled pass's kernels put in kinds by name, the GPU's busy time as the
union of the kernels' intervals, and the GEMMs' rate from the linear layers' FLOPs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def kinds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("kernel_kinds")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal", "gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
    ("aten::addmm", "gemm"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("triton_tem_fused__to_copy__unsafe_view_flex_attention_transpose_view_6", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled_elementwise"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gated_delta_net"),
    ("solve_tril_16x16_kernel", "gated_delta_net"),
    ("merge_16x16_to_64x64_inverse_kernel", "gated_delta_net"),
    ("layer_norm_gated_fwd_kernel", "gated_delta_net"),
    ("void causal_conv1d_fwd_kernel<Causal_conv1d_fwd_kernel_traits<128, 4, true, true>", "short_convolution"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>", "elementwise"),
    ("Memset (Device)", "copy"),
    ("some_kernel_nobody_named", "other"),
])
def test_a_kernel_falls_in_the_first_kind_its_name_matches(kinds, name, kind):
    assert kinds.kind_of(name) == kind


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all(kinds):
    # 0-10 and 5-12 overlap (12 us busy), 20-25 after a gap, 21-22 inside it: 17 us in all
    assert kinds.busy_seconds([(20, 25), (0, 10), (5, 12), (21, 22)]) == pytest.approx(17e-6)
    assert kinds.busy_seconds([]) == 0.0


def test_a_profiled_cpu_pass_gives_each_kind_its_share_and_the_gemms_their_rate(kinds):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
    tokens = 512
    x = torch.randn(tokens, 64)
    flops = kinds.linear_flops_per_token(model) * tokens
    assert flops == 2 * (64 * 256 + 256 * 64) * tokens
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        for _ in range(5):
            model(x)
    out = kinds.kernel_kinds(prof, on_gpu=False, wall_s=1.0, tokens=5 * tokens, flops={"gemm": 5 * flops}, peak_flops=1e12)
    assert "gemm" in out["by_kind"] and "elementwise" in out["by_kind"]
    assert sum(row["share"] for row in out["by_kind"].values()) == pytest.approx(1.0, abs=1e-3)
    gemm_s = 5 * tokens / out["gemm_ceiling_tokens_per_s"]  # the GEMMs' seconds, unrounded
    assert gemm_s == pytest.approx(out["by_kind"]["gemm"]["seconds"], abs=1e-4)
    gemm = out["by_kind"]["gemm"]
    assert gemm["tflop_per_s"] * 1e12 == pytest.approx(5 * flops / gemm_s, rel=0.01, abs=1e10)
    assert gemm["of_peak"] == pytest.approx(gemm["tflop_per_s"] * 1e12 / 1e12, abs=1e-2)
    assert "tflop_per_s" not in out["by_kind"]["elementwise"]  # no FLOPs given for it
    assert "busy_s" not in out  # no device timeline on a CPU
