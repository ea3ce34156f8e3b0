"""Block-FP8 linear (ops/quant): the 128x128 weight quantization round-trips within e4m3's resolution; the
Triton GEMM (each orientation, split-K — called directly: the op sends M = 1 to the GEMV, tests/ops/test_fp8_gemv.py;
Triton's CPU interpreter in CI — its fp8 cast and dot are made
exact by ops/quant/tl_fp8.py — and the GPU on the device) and the dequantizing PyTorch path against a float64 reference of the same
quantized math, at odd M, N multiple and not multiple of 128, K with a partial last block; activation
quantization identical in both paths; a dense tail; bad weights refused."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import dequantize_weight, fp8_linear, quantize_act, quantize_weight
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.fp8_ref import fp8_linear_float64

pytestmark = pytest.mark.usefixtures("seed")
# output rounding only: float32 out ~ accumulation order, bf16 out ~ one bf16 rounding (2^-9 relative)
TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3}


def weights(N, K, device):
    w = torch.randn(N, K, device=device) * 0.05
    w[: min(N, 128), : min(K, 128)] *= 20            # blocks of very different scales
    return (w,) + quantize_weight(w)


def qweights(N, K, device):
    """``weights`` without the unquantized w: (q, s)."""
    return weights(N, K, device)[1:]


def tail_reference(x, q, s, tail):
    """The float64 reference of ``fp8_linear`` with a dense tail (None: without)."""
    ref = fp8_linear_float64(x, q, s)
    return ref if tail is None else torch.cat([ref, x.double() @ tail.double().T], 1)


def test_weight_blocks_round_trip(device):
    w, q, s = weights(200, 300, device)
    assert q.dtype == torch.float8_e4m3fn and list(s.shape) == [2, 3]
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of the block's amax
    err = (dequantize_weight(q, s) - w).abs()
    assert (err <= s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 448 / 16).all()
    assert rel_rms(dequantize_weight(q, s), w) < 0.04


@pytest.mark.parametrize("M", [1, 3, 65, 300])
@pytest.mark.parametrize("N,K", [(128, 256), (200, 384), (256, 300)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_against_float64(M, N, K, backend, device):
    dtype = torch.bfloat16 if backend == "triton" or device.type == "cuda" else torch.float32
    if M == 300 and backend == "triton" and device.type == "cpu" and K != 300:
        pytest.skip("one large-M case per backend is enough under the interpreter")
    x = torch.randn(M, K, device=device).to(dtype)
    _, q, s = weights(N, K, device)
    y = fp8_linear(x, q, s, backend=backend)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_rms(y, fp8_linear_float64(x, q, s)) < TOL[dtype]


@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 72, 600, None),                          # decode config: split-K (3 splits, the last one K block)
    (3, 200, 1000, (16, 64, 4, 4, 1, 64, True)),     # split-K, partial N tile and partial last K block
    (65, 130, 520, (64, 64, 4, 3, 2, 32, True)),     # two token tiles, grouped weight tiles, split-K
    (17, 256, 384, (32, 128, 4, 3, 1, 0, True)),     # no split: rounded in the GEMM
    (70, 200, 300, (64, 64, 4, 3, 2, 0, False)),     # the usual orientation (large M)
    (5, 72, 600, (16, 64, 4, 3, 1, 64, False)),      # ... with split-K
])
def test_tiles_and_split_k(M, N, K, cfg, device, monkeypatch):
    from gdnserve.ops.quant import fp8_gemm_triton as g
    x = torch.randn(M, K, device=device).bfloat16()
    _, q, s = weights(N, K, device)
    y = g.fp8_gemm_triton(x, q, s, config=cfg)
    assert rel_rms(y, fp8_linear_float64(x, q, s)) < TOL[torch.bfloat16]
    assert torch.equal(y, g.fp8_gemm_triton(x, q, s, config=cfg))      # fixed reduction order


def test_split_k_plan():
    from gdnserve.ops.quant.fp8_gemm_triton import split_k
    assert split_k(192, 16, 528) == (3, 6)       # in_proj at decode: 576 programs
    assert split_k(32, 32, 528) == (16, 2)       # out_proj: 512 programs of 2 K blocks
    assert split_k(600, 16, 528) == (1, 16) and split_k(10, 3, 528) == (1, 3)


def test_float32_out_is_the_reference_math(device):
    x = torch.randn(5, 256, device=device)
    _, q, s = weights(130, 256, device)
    ref = fp8_linear_float64(x, q, s)
    for backend in ("torch", "triton"):
        assert rel_rms(fp8_linear(x, q, s, backend=backend), ref) < TOL[torch.float32]


def test_activation_quantization_same_in_both_paths(device):
    x = torch.randn(37, 300, device=device) * 7
    x[3] = 0                                          # an all-zero token: scale eps, values 0
    x[5, :128] = torch.logspace(-12, 3, 128, device=device)     # subnormals after scaling, a tie-rich range
    x[6, 128:256] = torch.arange(128, device=device) * 0.5 + 0.25
    qa, sa = quantize_act(x)
    qb, sb = quantize_act_triton(x)
    assert torch.equal(qa.float(), qb.float()) and torch.equal(sa, sb)
    assert sa.shape == (37, 3) and (qa[3].float() == 0).all()


def test_dense_tail_and_leading_dims(device):
    x = torch.randn(2, 3, 256, device=device)
    _, q, s = weights(128, 256, device)
    tail = torch.randn(7, 256, device=device) * 0.05
    for backend in ("torch", "triton"):
        y = fp8_linear(x, q, s, tail=tail, backend=backend)
        assert y.shape == (2, 3, 135)
        assert rel_rms(y[..., :128].reshape(6, 128), fp8_linear_float64(x.reshape(6, 256), q, s)) < TOL[torch.float32]
        assert rel_rms(y[..., 128:], x @ tail.T) < 1e-6


def test_bad_weights_refused(device):
    from gdnserve.ops.quant.fp8_linear import check_fp8_weight
    _, q, s = weights(128, 256, device)
    with pytest.raises(ValueError, match="weight_scale_inv must be float \\[1, 2\\]"):
        check_fp8_weight(q, s[:, :1], 256)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_fp8_weight(q.float(), s, 256)
