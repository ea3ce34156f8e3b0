"""The two conv-prefill kernels (ops/conv/prefill.py): "rows" (the GPU's: each input row loaded once, the W-1
previous inputs in registers) and "tile" (the interpreter's default: W shifted tiles) against the float64
reference and against each other, on packed varlen batches with parents, in-place slots, zero histories,
zero-length sequences, chunk boundaries (63/64/65/130 rows), strided inputs and several channel tiles."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.backend import interpreting
from gdnserve.ops.conv import causal_conv1d_prefill
from gdnserve.ops.conv.naive import naive_conv_prefill
from gdnserve.ops.conv.prefill import conv_prefill, use_kernel
from gdnserve.ops.varlen import VarlenMeta

pytestmark = pytest.mark.usefixtures("seed")
TOL = {torch.float32: dict(rtol=3e-4, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=5e-2)}


def _idx(v, dev):
    return torch.tensor(v, dtype=torch.int32, device=dev)


def _case(lens, parents, W, D, dtype, dev):
    N = len(lens)
    perm = torch.randperm(3 * N).tolist()
    src, dst = perm[:N], perm[N:2 * N]
    src[1] = -1                      # zeros history
    dst[-1] = -1                     # no write
    dst[3] = src[3]                  # in place
    x = torch.randn(sum(lens), D + 24, dtype=dtype, device=dev)[:, 5:5 + D]   # a strided column slice
    w = (torch.randn(D, W, device=dev) * 0.5).to(dtype)
    pool = torch.randn(3 * N + 1, W - 1, D, dtype=dtype, device=dev)
    return x, w, pool, src, dst


def _run(kernel, x, w, pool, lens, src, dst, parents, pad, tile=None):
    dev = x.device
    meta = VarlenMeta.build(lens, dev)
    meta = VarlenMeta.build(lens, dev, pad_chunks_to=meta.num_chunks + pad)
    par = None if parents is None else _idx(parents, dev)
    buf = torch.full((x.shape[0], x.shape[1] + 3), float("nan"), dtype=x.dtype, device=dev)
    y = buf[:, 1:1 + x.shape[1]]
    with use_kernel(kernel):
        if tile is None:
            causal_conv1d_prefill(x, w, pool, meta, _idx(src, dev), _idx(dst, dev), par, out=y, backend="triton")
        else:
            conv_prefill(x, w, pool, y, meta, _idx(src, dev), _idx(dst, dev), par, True, tile=tile)
    assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[:, -2:]).all(), "wrote outside out"
    return y


@pytest.mark.parametrize("W,D,dtype,tile", [(4, 40, torch.bfloat16, None), (3, 40, torch.float32, (16, 1, 4)),
                                            (2, 24, torch.bfloat16, (16, 2, 8))])
def test_rows_kernel_matches_naive_and_tile(W, D, dtype, tile, device):
    lens = [1, 2, 65, 64, 0, 130, 3, 63, 2]
    # seq 2 continues seq 0 (shorter than W-1: reaches seq 0's src slot), seq 6 continues the long seq 5,
    # seq 8 continues the empty seq 4 (pure src history)
    parents = [-1, -1, 0, -1, -1, -1, 5, -1, 4]
    x, w, pool, src, dst = _case(lens, parents, W, D, dtype, device)
    ref_y, ref_pool = naive_conv_prefill(x, w, pool, lens, src, dst, parents)
    pool_t = pool.clone()
    y_r = _run("rows", x, w, pool, lens, src, dst, parents, pad=2, tile=tile)
    torch.testing.assert_close(y_r.double().cpu(), ref_y.double().cpu(), **TOL[dtype])
    assert torch.equal(pool.cpu(), ref_pool.cpu()), "conv_pool differs from the reference (must be bit-exact)"
    y_t = _run("tile", x, w, pool_t, lens, src, dst, parents, pad=2)
    assert torch.equal(pool.cpu(), pool_t.cpu())
    if interpreting():   # the same fp32 operations; on the GPU, FMA contraction may differ by a rounding
        assert torch.equal(y_r.cpu(), y_t.cpu()), "rows and tile kernels differ"


def test_rows_kernel_single_token_and_zero_tokens(device):
    """T = 1 (a one-token prefill) and a zero-token call (history copies only)."""
    D, W = 24, 4
    x, w, pool, src, dst = _case([1, 0, 0, 0], None, W, D, torch.bfloat16, device)
    ref_y, ref_pool = naive_conv_prefill(x, w, pool, [1, 0, 0, 0], src, dst, None)
    y = _run("rows", x, w, pool, [1, 0, 0, 0], src, dst, None, pad=1)
    torch.testing.assert_close(y.double().cpu(), ref_y.double().cpu(), **TOL[torch.bfloat16])
    assert torch.equal(pool.cpu(), ref_pool.cpu())
    x0, w0, pool0, src0, dst0 = _case([0, 0, 0, 0], None, W, D, torch.bfloat16, device)
    _, ref_pool0 = naive_conv_prefill(x0, w0, pool0, [0, 0, 0, 0], src0, dst0, None)
    _run("rows", x0, w0, pool0, [0, 0, 0, 0], src0, dst0, None, pad=0)
    assert torch.equal(pool0.cpu(), ref_pool0.cpu())


def test_use_kernel_rejects_unknown():
    with pytest.raises(ValueError, match="kernel"):
        with use_kernel("nope"):
            pass
