"""Fused residual add + RMSNorm and the gated RMSNorm (ops/norm): the Triton kernels (CPU interpreter in CI,
the GPU on the device) against the unfused PyTorch path and the float64 reference, on odd sizes, strided
inputs and both activation dtypes."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.norm import gated_rms_norm, rms_norm
from gdnserve.ops.norm.naive import naive_gated_rms_norm, naive_rms_norm
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
REF_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}     # rel-RMS against float64
# vs PyTorch: ~16 fp32 ulps; bf16 two roundings (the GPU's approximate rsqrt / exp put 5 of 16.8M elements of the
# gated norm at T=4096 two bf16 ulps off on the H200)
ULP = {torch.float32: 2.0 ** -19, torch.bfloat16: 2.0 ** -6}


def close_to_torch(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Same shape and dtype; every element within one (bf16: two) roundings of the PyTorch path's (the mean square is
    reduced in another order: in fp32 a row's scale may differ by an ulp), in bf16 most of them bit-equal."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=ULP[y.dtype], atol=1e-6)
    if y.dtype == torch.bfloat16:
        assert (y == ref).float().mean() > 0.9


def wide(shape, dtype, device, extra: int = 7) -> torch.Tensor:
    """A tensor of ``shape`` as a column slice of a wider buffer (row stride > last dim)."""
    buf = torch.randn(*shape[:-1], shape[-1] + extra, device=device).to(dtype)
    return buf[..., 3:3 + shape[-1]]


@pytest.mark.parametrize("rows", [1, 3, 65])
@pytest.mark.parametrize("N", [96, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(rows, N, dtype, residual, device):
    x = wide((rows, N), dtype, device)
    r = (torch.randn(rows, N, device=device) * 3).to(dtype) if residual else None
    w = (torch.randn(N, device=device) * 0.2).to(dtype)
    got = rms_norm(x, w, 1e-6, r, backend="triton")
    want = rms_norm(x, w, 1e-6, r, backend="torch")
    ref, s_ref = naive_rms_norm(x, w, 1e-6, r)
    if residual:
        (y, s), (y_t, s_t) = got, want
        assert torch.equal(s, s_t) and torch.equal(s, s_ref) and s.is_contiguous()
    else:
        y, y_t = got, want
    close_to_torch(y, y_t)
    assert rel_rms(y, ref) < REF_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_view(dtype, device):
    """[T, G, N] views with two row strides (q of the attention's fused projection: per head [q | gate])."""
    T, G, N = 5, 3, 48
    qg = torch.randn(T, G, 2 * N, device=device).to(dtype)
    q = qg[..., :N]
    w = (torch.randn(N, device=device) * 0.2).to(dtype)
    y = rms_norm(q, w, 1e-6, backend="triton")
    close_to_torch(y, rms_norm(q, w, 1e-6, backend="torch"))
    assert rel_rms(y, naive_rms_norm(q, w, 1e-6)[0]) < REF_TOL[dtype]


def test_rms_norm_refuses_bad_inputs(device):
    x = torch.randn(4, 32, device=device)
    w = torch.zeros(32, device=device)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, torch.randn(4, 31, device=device), backend="triton")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.zeros(31, device=device), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.t(), torch.zeros(4, device=device), 1e-6, backend="triton")
    assert rms_norm(x[:0], w, 1e-6, x[:0], backend="triton")[0].shape == (0, 32)


@pytest.mark.parametrize("rows", [1, 3, 65])
@pytest.mark.parametrize("V", [96, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(rows, V, dtype, device):
    """x [rows, V] contiguous, z a strided column slice (as the GDN in-projection's z)."""
    x = torch.randn(rows, V, device=device).to(dtype)
    z = wide((rows, V), dtype, device) * 2
    w = (1 + 0.3 * torch.randn(V, device=device)).to(dtype)
    y = gated_rms_norm(x, z, w, 1e-6, backend="triton")
    close_to_torch(y, gated_rms_norm(x, z, w, 1e-6, backend="torch"))
    assert rel_rms(y, naive_gated_rms_norm(x, z, w, 1e-6)) < 2 * REF_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_gdn_layout(dtype, device):
    """The GDN call site: o [T, HV, V] contiguous, z [T, HV, V] a view into the projection output [T, cols];
    an fp32 weight with bf16 activations (the product then stays fp32, as torch promotes)."""
    T, HV, V, cols = 3, 5, 32, 5 * 32 + 21
    o = torch.randn(T, HV, V, device=device).to(dtype)
    proj = torch.randn(T, cols, device=device).to(dtype)
    z = proj[:, 7:7 + HV * V].view(T, HV, V)
    for w in ((1 + 0.3 * torch.randn(V, device=device)).to(dtype), 1 + 0.3 * torch.randn(V, device=device)):
        y = gated_rms_norm(o, z, w, 1e-6, backend="triton")
        assert y.shape == (T, HV, V) and y.is_contiguous()
        close_to_torch(y, gated_rms_norm(o, z, w, 1e-6, backend="torch"))
        assert rel_rms(y, naive_gated_rms_norm(o, z, w, 1e-6)) < 2 * REF_TOL[dtype]


def test_gated_rms_norm_refuses_bad_inputs(device):
    x = torch.randn(4, 32, device=device)
    with pytest.raises(ValueError, match="z"):
        gated_rms_norm(x, torch.randn(4, 33, device=device), torch.ones(32, device=device), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, x, torch.ones(31, device=device), 1e-6, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 256, 4096])
def test_bench_shapes(T, device):
    """The benchmark model's norms: hidden 2048 with the residual, the gated norm over [T, 32, 128]."""
    x, r = torch.randn(T, 2048, device=device).bfloat16(), torch.randn(T, 2048, device=device).bfloat16()
    w = (torch.randn(2048, device=device) * 0.1).bfloat16()
    (y, s), (y_t, s_t) = rms_norm(x, w, 1e-6, r, backend="triton"), rms_norm(x, w, 1e-6, r, backend="torch")
    assert torch.equal(s, s_t)
    close_to_torch(y, y_t)
    o, proj = torch.randn(T, 32, 128, device=device).bfloat16(), torch.randn(T, 12352, device=device).bfloat16()
    z = proj[:, 8192:8192 + 4096].view(T, 32, 128)
    g = torch.ones(128, device=device).bfloat16()
    close_to_torch(gated_rms_norm(o, z, g, 1e-6, backend="triton"), gated_rms_norm(o, z, g, 1e-6, backend="torch"))
