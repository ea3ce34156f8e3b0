"""GPU-only (the H200; CI skips): the quantized-input handover at Qwen3.5's real shapes — each producer's
``quant=True`` output equals ``quantize_act_triton`` of its own output bit for bit (hidden 2048, 32 value
heads of 128, 16 attention heads of 256), ``fp8_linear(..., xq=...)`` equals ``fp8_linear(...)`` bit for bit
on the GEMV (M = 1) and the Triton GEMM (M = 2 ... 16) for in_proj / qkv_proj / out_proj, ``quantizes_input``
says yes for those at decode, and a captured CUDA graph of producer + linear replays the eager numbers."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gating import sigmoid_mul
from gdnserve.ops.norm import gated_rms_norm, rms_norm
from gdnserve.ops.quant import fp8_linear, quantize_weight
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.fp8_linear import quantizes_input
from tests.ops.test_fp8_quant_handover import same_quant
from tests.ops.test_gpu_graphs import capture

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("seed")]
DEV = torch.device("cuda")
BF = torch.bfloat16
SHAPES = {"in_proj": (12288, 2048, 64), "qkv_proj": (9216, 2048, 0), "out_proj": (2048, 4096, 0)}   # N, K, tail


@pytest.mark.parametrize("T", [1, 3, 16, 77])
def test_producers_real_shapes(T):
    x, r = torch.randn(T, 2048, device=DEV).to(BF), torch.randn(T, 2048, device=DEV).to(BF)
    w = (0.1 * torch.randn(2048, device=DEV)).to(BF)
    y, s, xq = rms_norm(x, w, 1e-6, r, backend="triton", quant=True)
    assert torch.equal(y, rms_norm(x, w, 1e-6, r, backend="triton")[0])
    same_quant(xq, y)
    y, xq = rms_norm(x, w, 1e-6, backend="triton", quant=True)
    same_quant(xq, y)
    o = torch.randn(T, 32, 128, device=DEV).to(BF)
    z = torch.randn(T, 32, 256, device=DEV).to(BF)[..., 128:]
    g, xq = gated_rms_norm(o, z, (1 + 0.1 * torch.randn(128, device=DEV)).to(BF), 1e-6, backend="triton", quant=True)
    same_quant(xq, g.view(T, 4096))
    a = torch.randn(T, 4096, device=DEV).to(BF)
    gate = torch.randn(T, 16, 512, device=DEV).to(BF)[..., 256:]
    y, xq = sigmoid_mul(a, gate, backend="triton", quant=True)
    assert torch.equal(y, sigmoid_mul(a, gate, backend="triton"))
    same_quant(xq, y)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", [1, 2, 7, 16])
def test_linear_xq_real_shapes(name, M):
    N, K, N2 = SHAPES[name]
    q, s = quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
    tail = (torch.randn(N2, K, device=DEV) * 0.02).to(BF) if N2 else None
    x = torch.randn(M, K, device=DEV).to(BF)
    assert quantizes_input(x, N)
    want = fp8_linear(x, q, s, tail=tail)
    assert torch.equal(fp8_linear(x, q, s, tail=tail, xq=quantize_act_triton(x)), want)


def test_graph_replay_of_the_handover():
    N, K, N2 = SHAPES["in_proj"]
    q, s = quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
    tail = (torch.randn(N2, K, device=DEV) * 0.02).to(BF)
    h, r = torch.randn(1, K, device=DEV).to(BF), torch.randn(1, K, device=DEV).to(BF)
    w = (0.1 * torch.randn(K, device=DEV)).to(BF)
    out = {}

    def step():
        y, _, xq = rms_norm(h, w, 1e-6, r, backend="triton", quant=True)
        out["y"] = fp8_linear(y, q, s, tail=tail, xq=xq)

    g = capture(step)
    h.copy_(torch.randn_like(h))
    g.replay()
    torch.cuda.synchronize()
    y = rms_norm(h, w, 1e-6, r, backend="triton")[0]
    assert torch.equal(out["y"], fp8_linear(y, q, s, tail=tail))
