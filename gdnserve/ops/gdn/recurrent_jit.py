"""Jit helpers shared by the recurrent kernels (token-by-token and chunked)."""
import triton
import triton.language as tl

from gdnserve.ops.gdn import gates

# jit'ed code may read globals only as constexpr
SOFTPLUS_THRESHOLD = tl.constexpr(gates.SOFTPLUS_THRESHOLD)
L2_EPS = tl.constexpr(gates.L2_EPS)


@triton.jit
def _l2norm(b_x):
    return b_x * tl.math.rsqrt(tl.sum(b_x * b_x, 0) + L2_EPS)


@triton.jit
def _decay(b_a, b_dt, b_A):
    """g = -exp(A_log) * softplus(a + dt_bias), with b_A = -exp(A_log); all fp32 scalars."""
    b_x = b_a + b_dt
    # clamp before exp: the untaken branch of the select must not overflow
    b_sp = tl.where(b_x > SOFTPLUS_THRESHOLD, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, SOFTPLUS_THRESHOLD))))
    return b_A * b_sp


@triton.jit
def _delta_step(b_h, b_k, b_v, b_g, b_beta):
    """St <- exp(g) St; u = beta (v - St k); St <- St + u k^T. b_h [BV, BK], b_k [BK] (normalised)."""
    b_h = b_h * tl.exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
    return b_h + b_u[:, None] * b_k[None, :]


_STRIDES = ["s_qt", "s_qh", "s_kt", "s_kh", "s_vt", "s_vh", "s_at", "s_bt", "s_ot", "s_oh"]
