"""The attention prologue ops/attention/rope.rms_norm_rope: q/k RMSNorm + partial rotary in one Triton launch
(interpreted on CPU) against the PyTorch ops (RMSNorm then rotate-half with cos/sin tables) and float64."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.norm.naive import naive_rms_norm
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
ULP = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}   # fp32: the GPU's sin/cos are approximate (~5e-7 abs)


def naive(x, w, eps, positions, inv_freq):
    y = naive_rms_norm(x, w, eps)[0]
    # the angle as the model defines it: the fp32 product (at position 3e4 its rounding is ~1e-3 rad)
    f = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rd = cos.shape[-1]
    yr = y[..., :rd]
    rot = torch.cat([-yr[..., rd // 2:], yr[..., :rd // 2]], -1)
    return torch.cat([yr * cos + rot * sin, y[..., rd:]], -1)


@pytest.mark.parametrize("T,G,Dh,rd", [(1, 1, 32, 8), (3, 5, 96, 24), (65, 2, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_and_float64(T, G, Dh, rd, dtype, device):
    qg = torch.randn(T, G, 2 * Dh, device=device).to(dtype)
    q = qg[..., :Dh]                                   # per head [q | gate]: two row strides
    w = (torch.randn(Dh, device=device) * 0.2).to(dtype)
    positions = torch.randint(0, 40000, (T,), device=device)   # large angles: the in-kernel reduction
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rd, 2, device=device).float() / rd))
    y = rms_norm_rope(q, w, 1e-6, positions, inv_freq, backend="triton")
    want = rms_norm_rope(q, w, 1e-6, positions, inv_freq, backend="torch")
    assert y.shape == (T, G, Dh) and y.dtype == dtype and y.is_contiguous()
    torch.testing.assert_close(y.float(), want.float(), rtol=ULP[dtype], atol=2 * ULP[dtype])
    assert rel_rms(y, naive(q, w, 1e-6, positions, inv_freq)) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_refuses_bad_inputs(device):
    x = torch.randn(3, 2, 16, device=device)
    w, f = torch.zeros(16, device=device), torch.ones(4, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="positions"):
        rms_norm_rope(x, w, 1e-6, pos[:2], f, backend="triton")
    with pytest.raises(ValueError, match="rotary_dim"):
        rms_norm_rope(x, w, 1e-6, pos, torch.ones(9, device=device), backend="triton")
    with pytest.raises(ValueError, match=r"\[T, G, Dh\]"):
        rms_norm_rope(x[:, 0], w, 1e-6, pos, f, backend="triton")
