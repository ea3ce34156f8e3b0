"""Decode-sized block-FP8 GEMV (ops/quant/fp8_gemv_triton: x quantized once by its own launch, the weight
stream on the CUDA cores, the dense tail in the same launch) against the float64 reference of the same quantized
math, on fresh random inputs: M = 1 ... 4, N not a multiple of 128 (partial weight blocks) nor of the row tile,
K with a partial last block and K not a multiple of the K step, each config; deterministic; and the op
``fp8_linear`` dispatching M <= ``Fp8LinearConfig.gemv_max_m`` to it. Triton's CPU interpreter in CI, the GPU on the device."""
from __future__ import annotations

import importlib

import pytest
import torch

from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import fp8_linear
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.fp8_gemv_triton import GemvConfig, fp8_gemv
from tests.ops.test_fp8_linear import TOL
from tests.ops.test_fp8_linear import qweights as weights
from tests.ops.test_fp8_linear import tail_reference as reference

pytestmark = pytest.mark.usefixtures("seed")


def gemv(x, q, s, tail=None, fused=False):
    N2 = 0 if tail is None else tail.shape[0]
    y = torch.empty(x.shape[0], q.shape[0] + N2, dtype=x.dtype, device=x.device)
    xq, xs = (None, None) if fused else quantize_act_triton(x)
    return fp8_gemv(x, xq, xs, q, s, y, tail=tail)


@pytest.mark.parametrize("M,N,K,N2,cfg", [
    (1, 200, 600, 0, None),                          # the default rule: partial N tile, partial last K block
    (1, 256, 384, 7, GemvConfig(2, 256, 4, 1)),      # K = 1.5 steps; a 7-row dense tail (4 tail programs)
    (3, 130, 520, 5, GemvConfig(4, 128, 4, 2)),      # 3 tokens in a 4-row tile, 5 K blocks (last partial)
    (4, 72, 256, 0, GemvConfig(8, 512, 2, 1)),       # one K step wider than K
    (2, 128, 1000, 3, GemvConfig(16, 256, 4, 2)),
])
def test_gemv_against_float64(M, N, K, N2, cfg, device, monkeypatch):
    from gdnserve.ops.quant import fp8_gemv_triton as k
    if cfg is not None:
        monkeypatch.setattr(k, "_pick", lambda *a: cfg)      # (fp8_gemv's config= for direct calls)
    x = torch.randn(M, K, device=device).bfloat16()
    q, s = weights(N, K, device)
    tail = torch.randn(N2, K, device=device).bfloat16() * 0.05 if N2 else None
    y = gemv(x, q, s, tail)
    assert y.shape == (M, N + N2) and y.dtype == torch.bfloat16
    assert rel_rms(y, reference(x, q, s, tail)) < TOL[torch.bfloat16]
    assert torch.equal(y, gemv(x, q, s, tail))                        # deterministic


@pytest.mark.parametrize("N,K,N2,cfg", [
    (200, 600, 5, GemvConfig(4, 256, 4, 2)),         # partial N tile, partial last K block, a 5-row tail
    (256, 1024, 0, GemvConfig(16, 512, 4, 1)),       # even K steps
    (72, 300, 3, None),                              # the default rule
])
def test_gemv_quantizing_in_kernel(N, K, N2, cfg, device, monkeypatch):
    """M = 1 with x quantized inside the GEMV's programs: the same math as the two-launch path."""
    from gdnserve.ops.quant import fp8_gemv_triton as k
    if cfg is not None:
        monkeypatch.setattr(k, "_pick", lambda *a: cfg)      # (fp8_gemv's config= for direct calls)
    x = torch.randn(1, K, device=device).bfloat16()
    q, s = weights(N, K, device)
    tail = torch.randn(N2, K, device=device).bfloat16() * 0.05 if N2 else None
    y = gemv(x, q, s, tail, fused=True)
    assert rel_rms(y, reference(x, q, s, tail)) < TOL[torch.bfloat16]
    assert rel_rms(y, gemv(x, q, s, tail)) < TOL[torch.bfloat16]
    xf = x.float()
    assert rel_rms(gemv(xf, q, s, tail, fused=True), reference(xf, q, s, tail)) < TOL[torch.float32]
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(2, K, device=device), q, s, fused=True)


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_float32_is_the_reference_math(M, device):
    x = torch.randn(M, 300, device=device)
    q, s = weights(130, 300, device)
    tail = torch.randn(3, 300, device=device) * 0.05
    assert rel_rms(gemv(x, q, s, tail), reference(x, q, s, tail)) < TOL[torch.float32]


def test_gemv_refuses_more_rows(device):
    x = torch.randn(5, 256, device=device)
    q, s = weights(128, 256, device)
    with pytest.raises(ValueError, match="rows"):
        gemv(x, q, s)


def test_op_dispatches_small_m_to_gemv(device, monkeypatch):
    """fp8_linear at M <= Fp8LinearConfig.gemv_max_m takes the GEMV (its tail fused), above it quantization + GEMM: both equal
    to the PyTorch path up to accumulation order; a strided x (a row view) is read correctly."""
    op = importlib.import_module("gdnserve.ops.quant.fp8_linear")      # (the package exports the function)
    from gdnserve.ops.quant import fp8_gemv_triton as k
    calls = []
    real = k.fp8_gemv
    monkeypatch.setattr(k, "fp8_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    q, s = weights(256, 384, device)
    tail = torch.randn(8, 384, device=device) * 0.05
    # where x is quantized is decided at M = 1 only (gemv_quantizes_inside): M = 4 and 5 run once
    for fused, sizes in ((False, (1, 4, 5)), (True, (1,)), (None, (1,))):   # None: by the weight's size (inside)
        cfg = op.Fp8LinearConfig(gemv_max_m=4, gemv_quant_inside=fused)
        for M in sizes:
            x = torch.randn(M, 400, device=device)[:, :384]
            y = fp8_linear(x, q, s, tail=tail, backend="triton", config=cfg)
            assert rel_rms(y, fp8_linear(x, q, s, tail=tail, backend="torch")) < 2 * TOL[torch.float32]
    assert calls == [1, 4, 1, 1]
