"""Decode-sized block-FP8 linear (ops/quant/fp8_skinny_triton: one launch, x quantized in registers or
weight-only, the dense tail in the same launch) and the prefill path's cuBLAS block-scaled GEMM
(ops/quant/fp8_scaled_mm, GPU only) against the float64 reference of the same quantized math, on fresh random
inputs: odd M, N not a multiple of 128 (partial weight blocks), K with a partial last block, K-block counts
not a multiple of the per-iteration group, each config (CUDA-core and tensor-core tiles); deterministic.
Triton's CPU interpreter in CI, the GPU on the device."""
from __future__ import annotations

import importlib

import pytest
import torch

from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import fp8_linear
from tests.ops.test_fp8_linear import TOL
from tests.ops.test_fp8_linear import qweights as weights
from tests.ops.test_fp8_linear import tail_reference as reference

pytestmark = pytest.mark.usefixtures("seed")


def skinny(x, q, s, tail=None, quant_act=True):
    from gdnserve.ops.quant.fp8_skinny_triton import fp8_skinny
    N2 = 0 if tail is None else tail.shape[0]
    y = torch.empty(x.shape[0], q.shape[0] + N2, dtype=x.dtype, device=x.device)
    return fp8_skinny(x, q, s, y, tail=tail, quant_act=quant_act)


@pytest.mark.parametrize("M,N,K,N2,cfg", [
    (1, 200, 600, 0, None),                          # CUDA-core tiles, partial N tile, partial last K block
    (1, 256, 384, 7, (64, 2, 4, 1, False)),          # 3 K blocks, 2 per iteration; a 7-row dense tail
    (3, 72, 600, 0, None),                           # tensor-core tiles (BM 16), one partial N tile
    (16, 130, 520, 5, (32, 3, 4, 2, True)),          # 5 K blocks, 3 per iteration, tail
    (5, 256, 256, 0, (16, 1, 4, 1, True)),
    (2, 128, 300, 0, (16, 4, 4, 1, False)),          # CUDA-core tiles at M > 1: one program row per token
])
@pytest.mark.parametrize("quant_act", [True, False])
def test_skinny_against_float64(M, N, K, N2, cfg, quant_act, device, monkeypatch):
    from gdnserve.ops.quant import fp8_skinny_triton as k
    if cfg is not None:
        monkeypatch.setattr(k, "_pick", lambda *a: cfg)      # (fp8_skinny's config= for direct calls)
    x = torch.randn(M, K, device=device).bfloat16()
    q, s = weights(N, K, device)
    tail = torch.randn(N2, K, device=device).bfloat16() * 0.05 if N2 else None
    y = skinny(x, q, s, tail, quant_act)
    assert y.shape == (M, N + N2) and y.dtype == torch.bfloat16
    assert rel_rms(y, reference(x, q, s, tail, quant_act)) < TOL[torch.bfloat16]
    assert torch.equal(y, skinny(x, q, s, tail, quant_act))          # deterministic


@pytest.mark.parametrize("quant_act", [True, False])
@pytest.mark.parametrize("M", [1, 4])
def test_skinny_float32_is_the_reference_math(M, quant_act, device):
    x = torch.randn(M, 300, device=device)
    q, s = weights(130, 300, device)
    tail = torch.randn(3, 300, device=device) * 0.05
    y = skinny(x, q, s, tail, quant_act)
    assert rel_rms(y, reference(x, q, s, tail, quant_act)) < TOL[torch.float32]


def test_op_dispatch_small_m_matches_torch_path(device, monkeypatch):
    """fp8_linear with the skinny kernel on for M <= 16 (tail fused) and at M > 16 (quantization + GEMM) vs
    the PyTorch path, in both activation modes; DECODE_QUANT_ACT switches M <= 16 only."""
    op = importlib.import_module("gdnserve.ops.quant.fp8_linear")      # (the package exports the function)
    q, s = weights(256, 384, device)
    tail = torch.randn(8, 384, device=device) * 0.05
    monkeypatch.setattr(op, "SKINNY_MAX_M", 16)         # (off by default: slower on the H200 so far)
    for decode_quant in (True, False):
        monkeypatch.setattr(op, "DECODE_QUANT_ACT", decode_quant)
        for M in (1, 16, 21):
            x = torch.randn(M, 384, device=device)
            qa = decode_quant or M > 16
            y = fp8_linear(x, q, s, tail=tail, backend="triton")
            assert rel_rms(y, fp8_linear(x, q, s, tail=tail, backend="torch")) < 2 * TOL[torch.float32]
            assert rel_rms(y, reference(x, q, s, tail, qa)) < TOL[torch.float32]


def test_scaled_mm_not_used_on_cpu():
    from gdnserve.ops.quant.fp8_scaled_mm import shape_ok, use_scaled_mm
    assert not use_scaled_mm(torch.zeros(512, 256, dtype=torch.bfloat16), 256)
    assert shape_ok(512, 256, 512) and not shape_ok(510, 256, 512) and not shape_ok(512, 200, 512)
    assert not shape_ok(512, 256, 384)                   # 3 K blocks: not a multiple of 4


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,N2", [(512, 384, 512, 0), (1024, 256, 1024, 8), (516, 128, 512, 0)])
def test_scaled_mm_against_float64(M, N, K, N2, device):
    from gdnserve.ops.quant import fp8_scaled_mm as sm
    if not sm.available(device):
        pytest.skip("torch._scaled_mm has no block-wise scales on this device / torch")
    x = torch.randn(M, K, device=device).bfloat16()
    q, s = weights(N, K, device)
    tail = torch.randn(N2, K, device=device).bfloat16() * 0.05 if N2 else None
    assert sm.use_scaled_mm(x, N)
    y = fp8_linear(x, q, s, tail=tail)
    assert rel_rms(y, reference(x, q, s, tail, True)) < TOL[torch.bfloat16]
    assert torch.equal(y, fp8_linear(x, q, s, tail=tail))
