"""Triton helpers that behave the same on the GPU and under Triton's CPU interpreter.

Triton 3.6's interpreter (TRITON_INTERPRET=1, how CI runs our kernels) has two bf16 defects:
  - tl.dot on bf16/fp16 operands reads their raw bits -> garbage;
  - fp32 -> bf16 conversion truncates instead of rounding to nearest even.
Under the interpreter, ``mma`` upcasts operands (exact: they are already 16-bit values) and ``cast``
rounds to nearest even by bit arithmetic, so CPU tests see the GPU's numbers up to accumulation order.
On the GPU both are the plain Triton operations.
"""
import triton
import triton.language as tl

from gdnserve.ops.backend import interpreting

INTERPRET: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def cast(x, DT: tl.constexpr):
    """x.to(DT) with round-to-nearest-even also under the interpreter."""
    if INTERPRET:
        if DT == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(DT)
        else:
            return x.to(DT)
    else:
        return x.to(DT)
