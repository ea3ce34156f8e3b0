"""FP8 routed experts (ops/moe with block scales): the FP8 grouped Triton kernels (grouped_fp8_triton: each tile
config, the intermediate quantized in the gate_up epilogue or by its own launch; the decode path that small
calls take, decode_fp8_triton, in test_fp8_moe_decode.py) (Triton's CPU
interpreter in CI, the GPU on the device) and the dequantizing PyTorch path against a float64 reference of
the same quantized math, with an intermediate size that is not a multiple of 128 (partial scale blocks) and
one that is; scales of the wrong shape refused.

The intermediate is re-quantized, so a value that lands on a rounding tie of the e4m3 grid (h / s within an
fp32 ulp of the midpoint) can round either way depending on the summation order: one element off by one
e4m3 step moves that token's output by up to ~1.5%. So per token: the median error is the math's
precision, the worst token within one such flip."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdnserve.ops.moe import moe_experts
from gdnserve.ops.moe.fp8_torch import dequantize_gate_up
from gdnserve.ops.quant import dequantize_weight, quantize_weight
from gdnserve.ops.quant.fp8_ref import qdq_act

pytestmark = pytest.mark.usefixtures("seed")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}      # median per-token relative error
FLIP = 5e-2                                               # worst token (see the module docstring)


def fp8_experts(E, H, I, device):
    gu = torch.randn(E, 2 * I, H, device=device) / H ** 0.5
    dn = torch.randn(E, H, I, device=device) / I ** 0.5
    qg, sg = zip(*(quantize_weight(gu[e, :I]) for e in range(E)))
    qu, su = zip(*(quantize_weight(gu[e, I:]) for e in range(E)))
    q_gu = torch.stack([torch.cat([a, b]) for a, b in zip(qg, qu)])
    s_gu = torch.stack([torch.cat([a, b]) for a, b in zip(sg, su)])
    q_dn, s_dn = quantize_weight(dn)
    return q_gu, s_gu.contiguous(), q_dn, s_dn.contiguous()


def float64_ref(x, w, idx, q_gu, s_gu, q_dn, s_dn):
    """Same quantized math in float64: x and the intermediate through the per-token-group FP8 rounding."""
    gu = dequantize_gate_up(q_gu, s_gu, torch.float64)
    dn = dequantize_weight(q_dn, s_dn, torch.float64)
    I = dn.shape[2]
    xq = qdq_act(x).double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gu[e] @ xq[t]
            h = qdq_act((F.silu(h[:I]) * h[I:])[None].to(x.dtype))[0].double()
            out[t] += w[t, j].double() * (dn[e] @ h)
    return out


@pytest.mark.parametrize("T,H,I", [(1, 256, 128), (7, 128, 200), (33, 300, 64)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_experts_against_float64(T, H, I, backend, device):
    dtype = torch.bfloat16 if backend == "triton" or device.type == "cuda" else torch.float32
    E, k = 6, 2
    q_gu, s_gu, q_dn, s_dn = fp8_experts(E, H, I, device)
    x = torch.randn(T, H, device=device).to(dtype)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    out = moe_experts(x, w, idx, q_gu, q_dn, backend=backend, scales=(s_gu, s_dn))
    assert out.dtype == dtype and out.shape == x.shape
    ref = float64_ref(x, w, idx, q_gu, s_gu, q_dn, s_dn)
    tok = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert tok.max() < FLIP and (T == 1 or tok.median() < TOL[dtype])


@pytest.mark.parametrize("T,H,I,cfg", [
    (3, 300, 200, ((128, 8, 3), (128, 4, 3))),     # intermediate quantized in the gate_up epilogue
    (65, 256, 136, ((128, 8, 3), (64, 4, 3))),     # 32-row blocks, a partial last group, the epilogue path
    (5, 200, 264, ((64, 4, 3), (128, 4, 4))),      # quantized by its own launch, partial K and N tiles
    (2, 600, 72, ((32, 4, 3), (64, 4, 3))),        # 32 + 32-row gate/up tiles, a partial one
])
def test_fp8_triton_tile_configs(T, H, I, cfg, device, monkeypatch):
    from gdnserve.ops.moe import decode_fp8_triton as d
    from gdnserve.ops.moe import grouped_fp8_triton as g
    monkeypatch.setattr(g, "_pick", lambda *a: cfg)         # (moe_experts_fp8_triton's config= for direct calls)
    monkeypatch.setattr(d, "DECODE_MAX_PAIRS", 0)          # the grouped kernels at every size
    E, k = 5, 2
    q_gu, s_gu, q_dn, s_dn = fp8_experts(E, H, I, device)
    x = torch.randn(T, H, device=device).bfloat16()
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    out = moe_experts(x, w, idx, q_gu, q_dn, backend="triton", scales=(s_gu, s_dn))
    ref = float64_ref(x, w, idx, q_gu, s_gu, q_dn, s_dn)
    tok = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert tok.max() < FLIP and tok.median() < TOL[torch.bfloat16]


def test_fp8_scales_checked(device):
    q_gu, s_gu, q_dn, s_dn = fp8_experts(2, 128, 128, device)
    x = torch.randn(3, 128, device=device)
    w, idx = torch.ones(3, 1, device=device), torch.zeros(3, 1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="FP8 scales"):
        moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu[:, :1].contiguous(), s_dn))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_experts(x, w, idx, q_gu.float(), q_dn, scales=(s_gu, s_dn))
