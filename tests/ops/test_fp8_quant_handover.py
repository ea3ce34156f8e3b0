"""The quantized-input handover of the FP8 linears (issue 16): a producer op's ``quant=True`` output equals
``quantize_act_triton`` of its own rounded output bit for bit (Triton kernels under the interpreter in CI, the
PyTorch backends through ``fp8_ref``), and ``fp8_linear(x, ..., xq=quantize_act_triton(x))`` equals
``fp8_linear(x, ...)`` bit for bit on the GEMV (M = 1) and GEMM (M = 2 ... 16) paths; ``quantizes_input``
follows the op's branches; a malformed ``xq`` is refused naming the field."""
from __future__ import annotations

import importlib

import pytest
import torch

from gdnserve.ops.gating import sigmoid_mul
from gdnserve.ops.norm import gated_rms_norm, rms_norm
from gdnserve.ops.quant import fp8_linear, quantize_weight
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.fp8_linear import quantizes_input

pytestmark = pytest.mark.usefixtures("seed")
fp8_linear_mod = importlib.import_module("gdnserve.ops.quant.fp8_linear")    # (the package exports the function)


def same_quant(got, y2):
    """got (q, s) is quantize_act_triton(y2) bit for bit (and laid out like it)."""
    q, s = got
    q2, s2 = quantize_act_triton(y2.contiguous())
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and s.is_contiguous() and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("N", [2048, 200, 64])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rms_norm_quant(backend, N, with_res, device):
    dtype = torch.bfloat16
    for R in (1, 3, 17):
        x = torch.randn(R, N, device=device).to(dtype) * 3
        res = torch.randn(R, N, device=device).to(dtype) if with_res else None
        w = (torch.randn(N, device=device) * 0.2).to(dtype)
        base = rms_norm(x, w, 1e-6, res, backend=backend)
        out = rms_norm(x, w, 1e-6, res, backend=backend, quant=True)
        assert len(out) == (3 if with_res else 2)
        y = out[0]
        if with_res:
            assert torch.equal(y, base[0]) and torch.equal(out[1], base[1])
        else:
            assert torch.equal(y, base)
        same_quant(out[-1], y)


@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("N,K", [(256, 384), (200, 300)])
def test_fp8_linear_takes_xq(M, N, K, device, monkeypatch):
    monkeypatch.setattr(fp8_linear_mod, "QX_MAX_WEIGHTS", 0)                 # M = 1: the two-launch GEMV
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    q, s = quantize_weight(torch.randn(N, K, device=device) * 0.05)
    tail = (torch.randn(4, K, device=device) * 0.05).to(torch.bfloat16) if M % 2 else None
    want = fp8_linear(x, q, s, tail=tail, backend="triton")
    got = fp8_linear(x, q, s, tail=tail, backend="triton", xq=quantize_act_triton(x))
    assert torch.equal(got, want)
    assert torch.equal(fp8_linear(x, q, s, tail=tail, backend="torch", xq=quantize_act_triton(x)),
                       fp8_linear(x, q, s, tail=tail, backend="torch"))


def test_quantizes_input_follows_the_branches(device, monkeypatch):
    x1 = torch.randn(1, 256, device=device).to(torch.bfloat16)
    x8 = torch.randn(8, 256, device=device).to(torch.bfloat16)
    assert not quantizes_input(x1, 256, backend="torch") and not quantizes_input(x8, 256, backend="torch")
    assert quantizes_input(x8, 256, backend="triton")
    assert not quantizes_input(x8[:0], 256, backend="triton")
    assert not quantizes_input(x1, 256, backend="triton")                       # small weight: quantized inside
    monkeypatch.setattr(fp8_linear_mod, "QX_MAX_WEIGHTS", 1000)
    assert quantizes_input(x1, 256, backend="triton")                           # large weight: its own launch
    cfg = fp8_linear_mod.Fp8LinearConfig(gemv_quant_inside=True)
    assert not quantizes_input(x1, 256, backend="triton", config=cfg)         # inside, whatever the size
    with fp8_linear_mod.override(gemv_max_m=0):
        assert quantizes_input(x1, 256, backend="triton")                       # M = 1 through the GEMM


def test_bad_xq_refused(device):
    x = torch.randn(3, 256, device=device).to(torch.bfloat16)
    q, s = quantize_weight(torch.randn(128, 256, device=device))
    xq, xs = quantize_act_triton(x)
    for bad, field in (((xq[:2], xs), "q"), ((xq, xs.T.contiguous()), "s"), ((xq, xs.double()), "s"),
                       ((xq.view(torch.uint8), xs), "q")):
        with pytest.raises(ValueError, match=f"xq's {field}"):
            fp8_linear(x, q, s, backend="triton", xq=bad)
    with pytest.raises(ValueError, match="pair"):
        fp8_linear(x, q, s, backend="triton", xq=xq)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("G,V", [(4, 128), (3, 128), (2, 64), (3, 64), (1, 256), (2, 96)])
def test_gated_rms_norm_quant(backend, G, V, device):
    """[T, G, V] -> out and out.view(T, G·V)'s quantization: whole-group tiles (V = 128 one row a group, V = 64
    two rows, V = 256 two groups a row), G·V not a multiple of 128 and V not a power of two (the separate
    launch); z a strided view as the GDN mixer passes it."""
    dtype = torch.bfloat16
    for T in (1, 3, 17):
        x = torch.randn(T, G, V, device=device).to(dtype)
        z = torch.randn(T, G, 2 * V, device=device).to(dtype)[..., V:]
        w = (1 + 0.1 * torch.randn(V, device=device)).to(dtype)
        base = gated_rms_norm(x, z, w, 1e-6, backend=backend)
        out, xq = gated_rms_norm(x, z, w, 1e-6, backend=backend, quant=True)
        assert torch.equal(out, base)
        same_quant(xq, out.view(T, G * V))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("C,G", [(256, 4), (200, 0), (64, 1), (2304, 0)])
def test_sigmoid_mul_quant(backend, C, G, device):
    """x * sigmoid(gate) (+ add) and its quantization: attention's per-head gate view [T, G, C / G], a full
    [T, C] gate with a partial last group (200), one group narrower than 128, several column tiles (2304)."""
    dtype = torch.bfloat16
    for T, with_add in ((1, False), (3, True), (17, False)):
        x = torch.randn(T, C, device=device).to(dtype)
        g = (torch.randn(T, G, 2 * (C // G), device=device).to(dtype)[..., C // G:] if G
             else torch.randn(T, C, device=device).to(dtype))
        add = torch.randn(T, C, device=device).to(dtype) if with_add else None
        base = sigmoid_mul(x, g, add, backend=backend)
        y, xq = sigmoid_mul(x, g, add, backend=backend, quant=True)
        assert torch.equal(y, base)
        same_quant(xq, y)
