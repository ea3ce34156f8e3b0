"""Row blocks of the gated RMSNorm and the q/k norm + rotary kernels (a program normalises BR rows): blocks that
cross token boundaries ([T, G, N] with G odd), a partial last block, strided inputs as the layers pass them, and
explicit tiles, against the PyTorch path (HF's roundings) and float64."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.attention.rope_triton import rms_norm_rope_triton
from gdnserve.ops.norm.gated import gated_rms_norm_torch
from gdnserve.ops.norm.gated_triton import gated_rms_norm_triton
from gdnserve.ops.norm.naive import naive_gated_rms_norm
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
ULP = {torch.float32: 2.0 ** -19, torch.bfloat16: 2.0 ** -6}


@pytest.mark.parametrize("T,G,V,tile", [(63, 5, 32, (4, 1)), (65, 3, 48, None), (1, 32, 128, None),
                                         (7, 5, 128, (8, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_row_blocks(T, G, V, tile, dtype, device):
    o = torch.randn(T, G, V, device=device).to(dtype)
    proj = torch.randn(T, G * V + 19, device=device).to(dtype)
    z = proj[:, 11:11 + G * V].view(T, G, V)                          # strided: the in-projection's z columns
    w = (1 + 0.3 * torch.randn(V, device=device)).to(dtype)
    y = gated_rms_norm_triton(o, z, w, 1e-6, tile=tile)
    want = gated_rms_norm_torch(o, z, w, 1e-6)
    torch.testing.assert_close(y.float(), want.float(), rtol=ULP[dtype], atol=1e-6)
    assert rel_rms(y, naive_gated_rms_norm(o, z, w, 1e-6)) < (2e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("T,G,Dh,rd,tile", [(63, 3, 64, 16, (4, 1)), (65, 2, 256, 64, None), (1, 16, 256, 64, None),
                                            (5, 3, 40, 12, (2, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_row_blocks(T, G, Dh, rd, tile, dtype, device):
    qg = torch.randn(T, G, 2 * Dh, device=device).to(dtype)
    q = qg[..., :Dh]                                                   # per head [q | gate]
    w = (torch.randn(Dh, device=device) * 0.2).to(dtype)
    positions = torch.randint(0, 40000, (T,), device=device)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rd, 2, device=device).float() / rd))
    y = rms_norm_rope_triton(q, w, 1e-6, positions, inv_freq, tile=tile)
    want = rms_norm_rope(q, w, 1e-6, positions, inv_freq, backend="torch")
    ulp = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(y.float(), want.float(), rtol=ulp, atol=2 * ulp)
