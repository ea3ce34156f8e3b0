"""FP8 routed experts at decode sizes (``ops/moe/decode_fp8_triton``: two GEMV launches, x and the
intermediate quantized in registers or by their own launches, the k-sum in the down kernel) against the
float64 reference of the same quantized math (``test_fp8_moe.float64_ref``) and the grouped kernels, at
T = 1, 3, 16 with odd H and I (partial scale blocks, partial row tiles), each config flag; Triton's CPU
interpreter in CI, the GPU on the device. Tolerances: ``test_fp8_moe`` (per token: median at the math's
precision, the worst within one e4m3 rounding flip of the re-quantized intermediate)."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe import decode_fp8_triton as d
from gdnserve.ops.moe import moe_experts
from tests.ops.test_fp8_moe import FLIP, TOL, float64_ref, fp8_experts

pytestmark = pytest.mark.usefixtures("seed")


def _case(T, H, I, E, k, dtype, device):
    q_gu, s_gu, q_dn, s_dn = fp8_experts(E, H, I, device)
    x = torch.randn(T, H, device=device).to(dtype)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return x, w, idx, (q_gu, s_gu, q_dn, s_dn)


def _check(out, x, w, idx, wts):
    ref = float64_ref(x, w, idx, *wts)
    tok = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert tok.max() < FLIP and (x.shape[0] < 3 or tok.median() < TOL[x.dtype]), tok


@pytest.mark.parametrize("T,H,I,E,k,cfg", [
    (1, 256, 136, 9, 3, d.DecodeConfig(BR=8, KG=1, BR2=16)),              # narrow tiles, one K block a step
    (3, 300, 136, 7, 2, d.DecodeConfig(BR=16, KG=2, BR2=32, QX=False)),   # x by its own launch, partial K step
    (3, 200, 72, 6, 2, d.DecodeConfig(BR=32, KG=4, BR2=64, QH=False)),    # intermediate by its own launch
    (16, 136, 72, 10, 2, None),                                           # the default config, tokens sharing experts
    (3, 300, 200, 9, 3, d.DecodeConfig(BR=32, BR2=16, PAR=True)),          # the pairs as a tile axis (k = 3: padded)
    (2, 136, 136, 6, 4, d.DecodeConfig(BR=32, BR2=32, PAR=True, QH=False)),
    (1, 200, 136, 11, 9, d.DecodeConfig(BR=32, BR2=32, PAR=True)),         # k + 1 = 9 (a folded shared expert): 8 + 1
])
def test_decode_against_float64(T, H, I, E, k, cfg, device, monkeypatch):
    if cfg is not None:
        monkeypatch.setattr(d, "_pick", lambda *a: cfg)      # (moe_experts_fp8_decode's config= for direct calls)
    x, w, idx, wts = _case(T, H, I, E, k, torch.bfloat16, device)
    assert d.uses_decode(T * k)
    out = moe_experts(x, w, idx, wts[0], wts[2], backend="triton", scales=(wts[1], wts[3]))
    _check(out, x, w, idx, wts)
    if cfg is not None and not cfg.QH:     # deterministic: the same bits again
        assert torch.equal(out, moe_experts(x, w, idx, wts[0], wts[2], backend="triton", scales=(wts[1], wts[3])))


def test_decode_float32_strided_x(device):
    """Float32 activations (reference models: exact products, held to 1e-5) and x rows with a stride."""
    x, w, idx, wts = _case(3, 130, 72, 5, 2, torch.float32, device)
    xs = torch.cat([x, torch.randn_like(x)], 1)[:, :130]
    out = moe_experts(xs, w, idx, wts[0], wts[2], backend="triton", scales=(wts[1], wts[3]))
    _check(out, x, w, idx, wts)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")   # the grouped path's
def test_decode_matches_grouped(device, monkeypatch):                                   # unused padded rows
    """The decode path and the grouped kernels give the same result up to the fp32 summation order."""
    x, w, idx, wts = _case(2, 200, 136, 6, 3, torch.bfloat16, device)
    fast = moe_experts(x, w, idx, wts[0], wts[2], backend="triton", scales=(wts[1], wts[3]))
    monkeypatch.setattr(d, "DECODE_MAX_PAIRS", 0)
    grouped = moe_experts(x, w, idx, wts[0], wts[2], backend="triton", scales=(wts[1], wts[3]))
    rel = (fast.double() - grouped.double()).norm(dim=1) / grouped.double().norm(dim=1)
    assert rel.max() < FLIP and rel.median() < TOL[torch.bfloat16]
