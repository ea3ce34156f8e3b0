"""Triton building blocks of the FP8 kernels: quantize an activation tile per row (token) and group of 128
columns, and the dot of a quantized tile with an e4m3 weight tile — the same numbers on the GPU and under
Triton's CPU interpreter. ``quant_cols`` is ``quant_tile`` along the other axis (the swapped tiles' token
columns: the experts' gate_up epilogue).

``quant_tile`` rounds to the e4m3 grid by arithmetic (round to nearest even, subnormals included, the
result kept in float32 — every e4m3 value is a float32), never by a float8 conversion in registers: Triton's
interpreter (3.6, 3.9) converts to float8e4nv with the wrong rounding in ~2% of values, and on the H200
(Triton 3.6) a GEMM that converted in registers and fed a native fp8 dot at 16-row tiles missed its
reference by 1.2% (the first FP8 device run, docs/models.md). A tile already on the grid converts
exactly under any rounding, so the quantization kernels store it as e4m3 safely.

``fp8_dot(q, b, NATIVE)``: ``NATIVE`` — both operands e4m3 (loaded from an e4m3 tensor), the
fp8 tensor-core dot (Hopper wgmma; its accumulation inside one dot is below fp32 precision, ~1e-4 relative
at K = 128-256 on the H200); otherwise both operands upcast to bf16 (exact: e4m3 ⊂ bf16) and a bf16 dot with
float32 accumulation (float32 outputs, where the reference is held to ~1e-6; the old FP8 branch of
``moe/grouped_triton.py``) — the same products either way. Under
the interpreter (whose fp8 and bf16 dots read raw bits) both are float32 IEEE dots of the exact values.
Divisions are ``div_rn`` so the scale and the quotient match PyTorch's float32 ``/``.
"""
import triton
import triton.language as tl

from gdnserve.ops.tl_compat import INTERPRET

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
ACT_EPS: tl.constexpr = tl.constexpr(1e-10)


@triton.jit
def _rne_e4m3(v):
    """float32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), as float32."""
    bits = v.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, -6)                                   # below 2^-6: subnormal spacing 2^-9
    inv_ulp = ((130 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)    # 2^(3-e): 3 mantissa bits
    ulp = ((e + 124).to(tl.uint32) << 23).to(tl.float32, bitcast=True)        # 2^(e-3)
    t = v * inv_ulp                                         # exact (power of two)
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)
    return r * ulp


@triton.jit
def quant_tile(a):
    """a [BM, BK] float32 (BK = the group, masked entries 0) -> (q [BM, BK] float32 on the e4m3 grid,
    s [BM] float32): s = max(amax, 1e-10) / 448, q = e4m3(clamp(a / s, ±448))."""
    amax = tl.max(tl.abs(a), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, ACT_EPS), tl.full(amax.shape, FP8_MAX, tl.float32))
    v = tl.math.div_rn(a, tl.broadcast_to(s[:, None], a.shape))
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    return _rne_e4m3(v), s


@triton.jit
def quant_cols(a):
    """``quant_tile`` along the other axis: a [BK, BN] float32 (a group of BK = 128 rows per column, masked
    entries 0; the swapped tiles' token columns) -> (q [BK, BN] float32 on the e4m3 grid, s [BN])."""
    amax = tl.max(tl.abs(a), axis=0)
    s = tl.math.div_rn(tl.maximum(amax, ACT_EPS), tl.full(amax.shape, FP8_MAX, tl.float32))
    v = tl.math.div_rn(a, tl.broadcast_to(s[None, :], a.shape))
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    return _rne_e4m3(v), s


@triton.jit
def as_fp8_operand(q):
    """A tile loaded from an e4m3 tensor as the NATIVE dot's operand (float32 under the interpreter)."""
    if INTERPRET:
        return q.to(tl.float32)
    else:
        return q


@triton.jit
def fp8_dot(q, b, NATIVE: tl.constexpr):
    """q [BM, BK] quantized activations (float32 on the e4m3 grid from ``quant_tile``; e4m3 when NATIVE) ·
    b [BK, BN] e4m3 weights -> float32 (see the module docstring)."""
    if INTERPRET:
        return tl.dot(q.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif NATIVE:
        return tl.dot(q, b)
    else:
        return tl.dot(q.to(tl.bfloat16), b.to(tl.bfloat16))
