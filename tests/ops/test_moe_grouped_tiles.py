"""The grouped GEMM's shape-chosen paths against the float64 reference at small odd sizes: every row block
(BM 16..128), both program orders, gate and up as one MMA or two, weight tiles by pointer or TMA descriptor,
K steps and N tiles that do not divide H / I, the k-sum with H not a multiple of its block, any top_k (the shared expert folded in as one more pair per
token); and the shape rules (block_rows, config) themselves."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe import grouped_triton as gt
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe.grouped_triton import Config, Tiles
from gdnserve.ops.moe.naive import naive_moe_experts
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
H, I = 72, 40                       # neither a multiple of the K steps / N tiles below


def case(T, E, k, dtype, device):
    x = torch.randn(T, H, device=device).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device=device) / H ** 0.5).to(dtype)
    dn = (torch.randn(E, H, I, device=device) / I ** 0.5).to(dtype)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(dtype).contiguous(), idx, gu, dn


def run(cfg, BM, x, w, idx, gu, dn, monkeypatch):
    return gt.moe_experts_triton(x, w, align_pairs(idx, gu.shape[0], BM), gu, dn, idx.shape[1], config=cfg)


@pytest.mark.parametrize("T,BM,cfg,dtype", [
    (65, 128, Config(Tiles(32, 32, 4, 3), Tiles(64, 32, 4, 3), 64), torch.bfloat16),
    (65, 64, Config(Tiles(32, 32, 4, 3, True), Tiles(32, 16, 4, 2, True), 32), torch.float32),
    (65, 128, Config(Tiles(16, 32, 4, 3, True, True), Tiles(32, 32, 4, 3), 1024), torch.bfloat16),
    (3, 16, Config(Tiles(32, 64, 4, 2, False, True), Tiles(16, 64, 4, 2), 512), torch.float32),
    (33, 64, Config(Tiles(32, 32, 4, 3, True, False, True), Tiles(32, 32, 4, 3, False, False, True), 64),
     torch.bfloat16),                                             # TMA descriptors (grouped_tma_triton)
    (21, 32, Config(Tiles(16, 32, 4, 3, False, True, True), Tiles(64, 16, 4, 2, True, False, True), 32),
     torch.float32),                                              # one_dot + tma: the TMA kernel (two MMAs)
    (1, 16, None, torch.bfloat16),
    (3, 32, None, torch.float32),
])
def test_tiles_against_float64(T, BM, cfg, dtype, monkeypatch, device):
    x, w, idx, gu, dn = case(T, 6, 3, dtype, device)
    out = run(cfg, BM, x, w, idx, gu, dn, monkeypatch)
    assert out.dtype == dtype and out.shape == (T, H)
    assert rel_rms(out, naive_moe_experts(x, w, idx, gu, dn)) < TOL[dtype]


def test_shared_expert_pair(monkeypatch, device):
    """top_k + 1 pairs per token over E + 1 experts, the last one every token's (the shared expert folded in)."""
    T, E, k = 5, 7, 3
    x, w, idx, gu, dn = case(T, E, k, torch.float32, device)
    idx = torch.cat([idx, torch.full((T, 1), E, dtype=idx.dtype, device=device)], 1)
    w = torch.cat([w, torch.rand(T, 1, device=device)], 1).contiguous()
    gu = torch.cat([gu, torch.randn(1, 2 * I, H, device=device) / H ** 0.5])
    dn = torch.cat([dn, torch.randn(1, H, I, device=device) / I ** 0.5])
    out = run(None, 16, x, w, idx, gu, dn, monkeypatch)
    assert rel_rms(out, naive_moe_experts(x, w, idx, gu, dn)) < TOL[torch.float32]


def test_shape_rules():
    assert [gt.block_rows(n, 256) for n in (8, 4096, 6144, 8192, 32768, 65536)] == [16, 16, 32, 64, 64, 128]
    assert gt.block_rows(8 * 4096, 64) == 128 and gt.block_rows(8 * 1024, 64) == 64
    for T in (1, 4, 16, 64, 256, 1024, 4096, 8192):
        for E in (64, 256):
            cfg = gt.config(8 * T, gt.block_rows(8 * T, E))
            assert all(t.BK > 0 and t.BN > 0 and t.warps in (1, 2, 4, 8) for t in cfg[:2]) and cfg.sum_block > 0


def test_fp8_row_block_128_matches_16(device):
    """The FP8 path (its own tiles, ``fp8_config``) at BM = 128, 8 warps, gives what it gives at BM = 16."""
    from gdnserve.ops.quant import quantize_weight
    T, E, k, H8, I8 = 65, 2, 1, 256, 128
    gu = torch.randn(E, 2 * I8, H8, device=device) / H8 ** 0.5
    dn = torch.randn(E, H8, I8, device=device) / I8 ** 0.5
    halves = [(quantize_weight(g[:I8]), quantize_weight(g[I8:])) for g in gu]      # gate rows, then up rows
    q_gu = torch.stack([torch.cat([a[0], b[0]]) for a, b in halves])
    s_gu = torch.stack([torch.cat([a[1], b[1]]) for a, b in halves]).contiguous()
    q_dn, s_dn = quantize_weight(dn)
    scales = (s_gu, s_dn.contiguous())
    x = torch.randn(T, H8, device=device).bfloat16()
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = w.bfloat16().contiguous()
    assert gt.fp8_config(2, 128, H8, I8).gate_up.warps == 8
    outs = [gt.moe_experts_triton(x, w, align_pairs(idx, E, BM), q_gu, q_dn, k, scales)
            for BM in (16, 128)]
    assert rel_rms(outs[1], outs[0].float()) < 1e-2


def test_tma_alignment_rule(device):
    """TMA descriptors only where bases and row strides are 16-byte aligned (else the pointer kernels run)."""
    from gdnserve.ops.moe.grouped_tma_triton import usable
    w = torch.empty(2, 16, 40, dtype=torch.bfloat16, device=device)
    assert usable(w) and usable(w, torch.empty(8, 24, device=device))
    assert not usable(torch.empty(2, 16, 36, dtype=torch.bfloat16, device=device))     # 72-byte rows
    assert not usable(torch.empty(2 * 16 * 40 + 4, dtype=torch.bfloat16, device=device)[4:].view(2, 16, 40))  # base


@pytest.mark.gpu
@pytest.mark.parametrize("BM", [64, 128])
def test_prefill_tiles_at_model_widths(BM, monkeypatch, device):
    """The tiles of prefill-sized steps (``config`` at 65536 pairs: TMA kernels where chosen) at the model's H, I,
    against float64 on sampled tokens (GPU only: the interpreter would take minutes at these widths)."""
    T, E, k, H2, I2 = 300, 8, 4, 2048, 512
    x = torch.randn(T, H2, device=device).bfloat16()
    gu = (torch.randn(E, 2 * I2, H2, device=device) / H2 ** 0.5).bfloat16()
    dn = (torch.randn(E, H2, I2, device=device) / I2 ** 0.5).bfloat16()
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16().contiguous()
    out = run(gt.config(65536, BM), BM, x, w, idx, gu, dn, monkeypatch)
    assert rel_rms(out[:16], naive_moe_experts(x[:16], w[:16], idx[:16], gu, dn)) < TOL[torch.bfloat16]


def test_float32_operands_fit_shared_memory():
    """The shape rule's tiles are tuned for 16-bit operands; in float32 (``--dtype float32`` on CUDA) every stage
    doubles, and BM 128's three stages of x + gate + up tiles ran out of shared memory on the H200. ``fit_stages``
    cuts stages to the budget and leaves 16-bit tiles as they are."""
    for BM in (16, 32, 64, 128):
        cfg = gt.config(65536, BM)
        for t, gu in ((cfg.gate_up, True), (cfg.down, False)):
            assert gt.fit_stages(t, BM, 2, gu) == t
            f = gt.fit_stages(t, BM, 4, gu)
            assert 1 <= f.stages <= t.stages and f._replace(stages=t.stages) == t
            assert f.stages == 1 or f.stages * (BM * t.BK + (2 if gu else 1) * t.BN * t.BK) * 4 <= gt.SMEM_BUDGET
    assert gt.fit_stages(gt.config(65536, 128).gate_up, 128, 4, True).stages == 1


@pytest.mark.gpu
def test_float32_prefill_tiles_launch(monkeypatch, device):
    """float32 at BM 128 (the TMA gate_up of the prefill rule) launches and matches float64."""
    T, E, k, H2, I2 = 300, 8, 4, 2048, 512
    x = torch.randn(T, H2, device=device)
    gu = torch.randn(E, 2 * I2, H2, device=device) / H2 ** 0.5
    dn = torch.randn(E, H2, I2, device=device) / I2 ** 0.5
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).contiguous()
    out = gt.moe_experts_triton(x, w, align_pairs(idx, E, 128), gu, dn, k)
    assert rel_rms(out[:16], naive_moe_experts(x[:16], w[:16], idx[:16], gu, dn)) < 1e-3
