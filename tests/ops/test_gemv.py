"""The one-launch skinny GEMM (ops/gemv; CPU interpreter in CI): against the float64 product and F.linear,
deterministic, K not a multiple of the K step, the CUDA-core variant's rows at M = 1..4 bit-identical whatever M
(batch invariance), the table lookup, and ``layers.linear.dense_linear``'s choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdnserve.layers.linear import RowParallelLinear, dense_linear
from gdnserve.ops import gemv
from gdnserve.ops.gemv import SkinnyConfig, skinny_config, skinny_linear
from gdnserve.ops.gemv import skinny_triton
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")


@pytest.mark.parametrize("M,N,K,cfg", [(1, 40, 192, SkinnyConfig(16, 64, 4, 3)),
                                       (3, 33, 200, SkinnyConfig(16, 64, 4, 2)),
                                       (16, 50, 96, SkinnyConfig(32, 32, 2, 3)),
                                       (1, 37, 200, SkinnyConfig(4, 64, 4, 2, False)),
                                       (1, 32, 256, SkinnyConfig(8, 128, 4, 1, False)),
                                       (2, 37, 200, SkinnyConfig(4, 64, 4, 2, False)),
                                       (3, 33, 136, SkinnyConfig(8, 256, 4, 1, False)),      # BK > K
                                       (4, 50, 264, SkinnyConfig(2, 128, 8, 2, False)),
                                       (4, 24, 256, SkinnyConfig(16, 64, 4, 1, False))])
def test_matches_float64(M, N, K, cfg, device):
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) * 0.05).to(torch.bfloat16)
    y = skinny_linear(x, w, cfg)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    assert rel_rms(y, ref) < 4e-3
    assert rel_rms(y, F.linear(x, w)) < 4e-3
    assert torch.equal(y, skinny_linear(x, w, cfg))          # fixed reduction order


@pytest.mark.parametrize("M,cfg", [(2, SkinnyConfig(16, 32, 4, 2)), (1, SkinnyConfig(8, 64, 4, 1, False)),
                                   (3, SkinnyConfig(16, 128, 4, 2)), (2, SkinnyConfig(4, 128, 4, 1, False)),
                                   (4, SkinnyConfig(8, 64, 4, 2, False))])
def test_gate_folded_into_x(M, cfg, device):
    """``gate`` [M, G, GD] (a strided view, as attention's per-head gate): the product of x * sigmoid(gate) as
    torch rounds it (sigmoid to bf16, then the product), K steps shorter and longer than GD."""
    G, GD, N = 3, 64, 24
    qg = torch.randn(M, G, 2 * GD, device=device).to(torch.bfloat16)
    gate = qg[..., GD:]
    x = torch.randn(M, G * GD, device=device).to(torch.bfloat16)
    w = (torch.randn(N, G * GD, device=device) * 0.05).to(torch.bfloat16)
    y = skinny_linear(x, w, cfg, gate=gate)
    xg = x * torch.sigmoid(gate.reshape(M, G * GD))
    assert rel_rms(y, xg.double() @ w.double().T) < 4e-3
    assert torch.equal(y, skinny_linear(x, w, cfg, gate=gate))
    with pytest.raises(ValueError, match="gate"):
        skinny_linear(x, w, cfg, gate=gate[:, :2])


@pytest.mark.parametrize("N,K,cfg", [(37, 200, SkinnyConfig(4, 64, 4, 2, False)),
                                     (24, 256, SkinnyConfig(8, 128, 4, 1, False)),
                                     (19, 72, SkinnyConfig(2, 128, 8, 1, False))])
def test_fma_rows_batch_invariant(N, K, cfg, device):
    """The CUDA-core variant at M = 1..4: row i's output is the same bits whatever M (the same W tile and per-row
    sums; the docstring's promise), x rows strided, with and without the gate."""
    G = 4 if K % 4 == 0 else 1
    base = torch.randn(4, K + 8, device=device).to(torch.bfloat16)
    x = base[:, 3:3 + K]                                   # row stride K + 8, not 16-byte aligned
    w = (torch.randn(N, K, device=device) * 0.05).to(torch.bfloat16)
    gate = torch.randn(4, G, 2 * K // G, device=device).to(torch.bfloat16)[..., K // G:]
    for g in (None, gate):
        full = skinny_linear(x, w, cfg, gate=g)
        for M in (1, 2, 3):
            assert torch.equal(skinny_linear(x[:M], w, cfg, gate=None if g is None else g[:M]), full[:M]), M
        xg = x if g is None else x * torch.sigmoid(g.reshape(4, K))
        assert rel_rms(full, xg.double() @ w.double().T) < 4e-3


def test_table_is_measured_and_ordered():
    """Every TABLE entry is measured (``PROVISIONAL`` empty; bench_skinny_m4 fills M = 2..4), bounds ascend, the
    CUDA-core variant only up to FMA_MAX_M rows; the H200 sweep's picks: cuBLAS keeps the large projections past
    M = 2 (GDN in_proj, out_proj) or 1 (qkv), the router runs the CUDA-core variant up to M = 4."""
    assert skinny_triton.PROVISIONAL == {}
    for (N, K), entries in skinny_triton.TABLE.items():
        bounds = [m for m, _ in entries]
        assert bounds == sorted(set(bounds)), (N, K)
        assert all(c.dot or m <= skinny_triton.FMA_MAX_M for m, c in entries), (N, K)
    assert skinny_config(2, 12352, 2048) == SkinnyConfig(32, 256, 4, 4) and skinny_config(3, 12352, 2048) is None
    assert skinny_config(2, 9216, 2048) is None
    assert skinny_config(4, 257, 2048) == SkinnyConfig(4, 2048, 4, 1, False)


def test_strided_rows_and_errors(device):
    base = torch.randn(4, 80, device=device).to(torch.bfloat16)
    x = base[:, 8:72]                                      # row stride 80
    w = torch.randn(24, 64, device=device).to(torch.bfloat16)
    cfg = SkinnyConfig(16, 32, 2, 2)
    assert torch.equal(skinny_linear(x, w, cfg), skinny_linear(x.contiguous(), w, cfg))
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(17, 64, dtype=torch.bfloat16, device=device), w, cfg)
    with pytest.raises(ValueError, match="skinny_linear: w"):
        skinny_linear(x, w[:, :32], cfg)
    with pytest.raises(ValueError, match="skinny_linear: x"):
        skinny_linear(x.float(), w, cfg)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(5, 64, dtype=torch.bfloat16, device=device), w,
                      SkinnyConfig(4, 64, 4, 1, False))       # the FMA variant: M <= 4
    fma = SkinnyConfig(8, 32, 4, 1, False)
    assert torch.equal(skinny_linear(x, w, fma), skinny_linear(x.contiguous(), w, fma))


def test_table_lookup(monkeypatch):
    cfg, one = SkinnyConfig(16, 256, 4, 4), SkinnyConfig(4, 512, 4, 1, False)
    monkeypatch.setattr(skinny_triton, "TABLE", {(2048, 4096): ((1, one), (8, cfg))})
    assert skinny_config(1, 2048, 4096) == one and skinny_config(2, 2048, 4096) == cfg
    assert skinny_config(8, 2048, 4096) == cfg
    assert skinny_config(9, 2048, 4096) is None and skinny_config(0, 2048, 4096) is None
    assert skinny_config(1, 2048, 2048) is None
    monkeypatch.setattr(skinny_triton, "TABLE", {(64, 64): ((8, one),)})       # a bad table: FMA past M = 4
    assert skinny_config(4, 64, 64) == one and skinny_config(5, 64, 64) is None
    assert gemv.skinny_config is skinny_config


def test_dense_linear_keeps_f_linear_off_cuda(monkeypatch):
    """On the CPU (and for shapes outside the table) ``dense_linear`` is F.linear, bit for bit."""
    monkeypatch.setattr(skinny_triton, "TABLE", {(24, 64): ((16, SkinnyConfig(16, 32, 2, 2)),)})
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(24, 64).to(torch.bfloat16)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    lin = RowParallelLinear(64, 24, tp_rank=0, tp_size=1).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)                                # torch.empty: NaNs would fail torch.equal
    gate = torch.randn(2, 4, 16).to(torch.bfloat16)
    assert torch.equal(lin.forward_gated(x, gate), lin(x * torch.sigmoid(gate.reshape(2, 64))))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(2048, 4096), (12352, 2048), (9216, 2048)])
def test_model_shapes_on_gpu(M, N, K, device):
    """The model's decode projections: every table config against cuBLAS's product to bf16 rounding."""
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    cfgs = {c for entries in skinny_triton.TABLE.values() for _, c in entries} | {SkinnyConfig(16, 256, 4, 4)}
    for cfg in cfgs:
        if not cfg.dot and M > skinny_triton.FMA_MAX_M:
            continue
        y = skinny_linear(x, w, cfg)
        assert rel_rms(y, ref) < 4e-3 and rel_rms(y, F.linear(x, w)) < 4e-3
        assert torch.equal(y, skinny_linear(x, w, cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(2048, 4096), (9216, 2048)])
def test_fma_rows_batch_invariant_on_gpu(N, K, device):
    """On the GPU the compiled per-M binaries keep the promise: every CUDA-core config of the table gives row i the
    same bits at M = 1..4 (mostly the binaries test_model_shapes_on_gpu compiles: few extra compiles)."""
    x = torch.randn(4, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16)
    cfgs = {c for entries in skinny_triton.TABLE.values() for _, c in entries if not c.dot and c.BK <= K}
    for cfg in cfgs:
        full = skinny_linear(x, w, cfg)
        assert rel_rms(full, x.double() @ w.double().T) < 4e-3
        for M in (1, 2, 3):
            assert torch.equal(skinny_linear(x[:M], w, cfg), full[:M]), (cfg, M)
