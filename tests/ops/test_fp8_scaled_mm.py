"""The prefill path's cuBLAS block-scaled GEMM (ops/quant/fp8_scaled_mm, GPU only) against the float64 reference
of the same quantized math, and where ``fp8_linear`` takes it (the dispatch's ``scaled_mm``)."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import fp8_linear
from tests.ops.test_fp8_linear import TOL
from tests.ops.test_fp8_linear import qweights as weights
from tests.ops.test_fp8_linear import tail_reference as reference

pytestmark = pytest.mark.usefixtures("seed")


def test_scaled_mm_not_used_on_cpu():
    from gdnserve.ops.quant.fp8_scaled_mm import shape_ok, use_scaled_mm
    assert not use_scaled_mm(torch.zeros(512, 256, dtype=torch.bfloat16), 256)
    assert shape_ok(512, 256, 512) and not shape_ok(510, 256, 512) and not shape_ok(512, 200, 512)
    assert not shape_ok(512, 256, 384)                   # 3 K blocks: not a multiple of 4


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,N2", [(512, 384, 512, 0), (1024, 256, 1024, 8), (516, 128, 512, 0)])
def test_scaled_mm_against_float64(M, N, K, N2, device):
    from gdnserve.ops.quant import fp8_scaled_mm as sm
    from gdnserve.ops.quant.fp8_linear import Fp8LinearConfig, override
    if not sm.available(device):
        pytest.skip("torch._scaled_mm has no block-wise scales on this device / torch")
    x = torch.randn(M, K, device=device).bfloat16()
    q, s = weights(N, K, device)
    tail = torch.randn(N2, K, device=device).bfloat16() * 0.05 if N2 else None
    assert sm.use_scaled_mm(x, N)
    y = fp8_linear(x, q, s, tail=tail)
    assert rel_rms(y, reference(x, q, s, tail)) < TOL[torch.bfloat16]
    assert torch.equal(y, fp8_linear(x, q, s, tail=tail))
    # scaled_mm off: the Triton GEMM, the same quantized math (an explicit config, or override for every call)
    gemm = fp8_linear(x, q, s, tail=tail, config=Fp8LinearConfig(scaled_mm=False))
    assert rel_rms(gemm, reference(x, q, s, tail)) < TOL[torch.bfloat16]
    with override(scaled_mm=False):
        assert torch.equal(fp8_linear(x, q, s, tail=tail), gemm)
