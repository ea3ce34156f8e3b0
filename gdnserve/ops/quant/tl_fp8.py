"""Triton building blocks of the FP8 kernels: quantize an activation tile per row (token) and group of 128
columns, and the fp8 tensor-core dot — the same numbers on the GPU and under Triton's CPU interpreter.

Triton's interpreter (3.6 and 3.9) converts to float8e4nv with the wrong rounding in ~2% of values and
reads the raw bits in tl.dot on fp8 operands; so under the interpreter ``quant_tile`` rounds to the e4m3
grid by arithmetic (round to nearest even, subnormals included) and keeps the result in float32 (exact:
every e4m3 value is a float32), and ``fp8_dot`` upcasts the weight tile (exact) and multiplies in IEEE
fp32. On the GPU both are the native operations (``cvt.rn.satfinite`` e4m3, fp8 wgmma / mma with fp32
accumulation). Divisions are ``div_rn`` so the scale and the quotient match PyTorch's float32 ``/``.
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
    ulp = ((e + 124).to(tl.uint32) << 23).to(tl.float32, bitcast=True)     # 2^(e-3): 3 mantissa bits
    t = v / ulp                                             # exact (power of two)
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)
    return r * ulp


@triton.jit
def quant_tile(a):
    """a [BM, BK] float32 (BK = the group, masked entries 0) -> (q [BM, BK], s [BM] float32):
    s = max(amax, 1e-10) / 448, q = clamp(a / s, ±448) in e4m3 (float32 holding e4m3 values under the
    interpreter)."""
    amax = tl.max(tl.abs(a), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, ACT_EPS), tl.full(amax.shape, FP8_MAX, tl.float32))
    v = tl.math.div_rn(a, tl.broadcast_to(s[:, None], a.shape))
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if INTERPRET:
        q = _rne_e4m3(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, s


@triton.jit
def as_fp8_operand(q):
    """A loaded float8e4nv tile as the dot's operand (float32 under the interpreter)."""
    if INTERPRET:
        return q.to(tl.float32)
    else:
        return q


@triton.jit
def fp8_dot(q, b):
    """q [BM, BK] (from ``quant_tile`` / ``as_fp8_operand``) · b [BK, BN] float8e4nv -> float32."""
    if INTERPRET:
        return tl.dot(q, b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(q, b)
