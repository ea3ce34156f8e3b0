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


@pytest.mark.parametrize("E,top_k", [(16, 4), (256, 8)])
def test_routing_in_the_same_launch_equals_route_triton(E, top_k):
    """The last program's routing and alignment of the row = route_triton on the logits, bit for bit (the
    logits are the same bits); the counter back at 0, twice in a row."""
    from gdnserve.ops.gemv.norm_gemv import add_rms_norm_gemv_route, new_counter
    from gdnserve.ops.moe.router import route
    g = torch.Generator().manual_seed(E)
    K = 128
    h, res = torch.randn(1, K, generator=g).to(BF16).to(DEV), torch.randn(1, K, generator=g).to(BF16).to(DEV)
    nw = (0.3 * torch.randn(K, generator=g)).to(BF16).to(DEV)
    w = (0.3 * torch.randn(E + 1, K, generator=g)).to(BF16).to(DEV)      # + the shared expert's gate row
    cnt = new_counter(DEV)
    for _ in range(2):
        r, x, s = add_rms_norm_gemv_route(h, res, nw, 1e-6, w, cnt, top_k, True, True)
        assert int(cnt.item()) == 0
    y, x2, s2 = add_rms_norm_gemv(h, res, nw, 1e-6, w)
    assert torch.equal(x, x2) and torch.equal(s, s2)
    r2 = route(y, top_k, True, "triton", shared=True)
    assert torch.equal(r.experts, r2.experts) and torch.equal(r.weights, r2.weights)
    assert r.alignment.BM == r2.alignment.BM
    assert torch.equal(r.alignment.rows, r2.alignment.rows)
    assert torch.equal(r.alignment.block_expert, r2.alignment.block_expert)


def test_rejects_two_rows():
    h = torch.randn(2, 64).to(BF16)
    with pytest.raises(ValueError, match="h"):
        add_rms_norm_gemv(h, h, torch.zeros(64), 1e-6, torch.randn(8, 64).to(BF16))
