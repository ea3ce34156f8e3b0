"""Residual add + RMSNorm folded into the one-row GEMV (ops/gemv/norm_gemv): against the two launches it replaces
(add_rms_norm + the CUDA-core GEMV's sums: the same bits on the CPU interpreter) and a float64 reference; fresh
random rows, K not a multiple of the K step, N not a multiple of the program's rows."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gemv.norm_gemv import add_rms_norm_gemv
from gdnserve.ops.norm import rms_norm
from gdnserve.ops.numerics import rel_rms

BF16 = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("N,K", [(37, 96), (257, 2048)])
def test_equals_norm_then_gemv_and_float64(N, K):
    g = torch.Generator().manual_seed(N)
    h, res = (3 * torch.randn(1, K, generator=g)).to(BF16).to(DEV), torch.randn(1, K, generator=g).to(BF16).to(DEV)
    nw = (0.3 * torch.randn(K, generator=g)).to(BF16).to(DEV)
    w = (0.05 * torch.randn(N, K, generator=g)).to(BF16).to(DEV)
    y, x, s = add_rms_norm_gemv(h, res, nw, 1e-6, w)
    x2, s2 = rms_norm(h, nw, 1e-6, res, backend="triton")
    assert torch.equal(s, s2) and (torch.equal(x, x2) if DEV == "cpu" else rel_rms(x.float(), x2.float()) < 4e-3)
    # the GEMV's sums: fp32 products of the rounded x, one rounding at the end
    y2 = (w.float() @ x2.float()[0]).to(BF16)[None]
    assert rel_rms(y.float(), y2.float()) < 4e-3
    sd = h.double() + res.double()
    xd = sd * torch.rsqrt(sd.pow(2).mean() + 1e-6) * (1 + nw.double())
    assert rel_rms(y.double(), xd @ w.double().T) < 8e-3
    assert rel_rms(x.double(), xd) < 8e-3


def test_rejects_two_rows():
    h = torch.randn(2, 64).to(BF16)
    with pytest.raises(ValueError, match="h"):
        add_rms_norm_gemv(h, h, torch.zeros(64), 1e-6, torch.randn(8, 64).to(BF16))
