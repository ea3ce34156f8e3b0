"""ops/gating: the Triton epilogues (silu * up, [add +] x * sigmoid(g) with a full, per-head strided or per-row
gate) against the PyTorch ops they replace: fp32 to fp32 rounding, bf16 within one rounding step."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gating import sigmoid_mul, silu_mul

pytestmark = pytest.mark.usefixtures("seed")


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Within one rounding step of the dtype, relative to ``scale`` (the terms' magnitude: a sum may cancel),
    default |want| (exp may differ in its last ulp, and the value then round the other way)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = 2.0 ** -7 if want.dtype == torch.bfloat16 else 2e-6
    scale = want.float().abs() if scale is None else scale.float()
    assert ((got.float() - want.float()).abs() <= scale * eps + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 8), (37, 24), (129, 520)])
def test_silu_mul(T, I, dtype, device):
    h = (torch.randn(T, 2 * I + 6, device=device) * 3).to(dtype)[:, 3:3 + 2 * I]     # a row stride > 2I
    close(silu_mul(h, backend="triton"), silu_mul(h, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,G,D,kind", [(1, 2, 8, "heads"), (45, 3, 40, "heads"), (33, 1, 100, "row"),
                                        (17, 1, 70, "full")])
@pytest.mark.parametrize("with_add", [False, True])
def test_sigmoid_mul(T, G, D, kind, with_add, dtype, device):
    C = G * D
    x = torch.randn(T, C, device=device).to(dtype)
    if kind == "heads":        # the attention gate: [T, G, D] halves of a [T, G, 2D] projection, read in place
        g = (torch.randn(T, G, 2 * D, device=device) * 3).to(dtype)[..., D:]
    elif kind == "row":
        g = (torch.randn(T, 2, device=device) * 3).to(dtype)[:, 1:]
    else:
        g = (torch.randn(T, C, device=device) * 3).to(dtype)
    add = torch.randn(T, C, device=device).to(dtype) if with_add else None
    got = sigmoid_mul(x, g, add, backend="triton")
    want = sigmoid_mul(x, g, add, backend="torch")
    close(got, want, x.abs() + (0 if add is None else add.abs()))
    ref = x * torch.sigmoid(g.reshape(T, -1))
    assert torch.equal(want, ref if add is None else add + ref)        # the PyTorch path is HF's ops


def test_empty_rows(device):
    x, g = torch.randn(0, 6, device=device), torch.randn(0, 1, device=device)
    for be in ("torch", "triton"):
        assert sigmoid_mul(x, g, x, backend=be).shape == (0, 6)
        assert silu_mul(torch.randn(0, 6, device=device), backend=be).shape == (0, 3)


def test_errors_name_the_argument(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="silu_mul: h"):
        silu_mul(torch.randn(4, 5, device=device))
    with pytest.raises(ValueError, match="sigmoid_mul: g"):
        sigmoid_mul(x, torch.randn(4, 4, device=device))
    with pytest.raises(ValueError, match="sigmoid_mul: add"):
        sigmoid_mul(x, x, torch.randn(4, 7, device=device))
