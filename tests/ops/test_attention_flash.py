"""The FlashAttention-style Triton kernel (flash_triton.py; interpreter on CPU) against the float64 reference, on
every tile path: GQA-packed decode tiles (BM 16/32), prefill tiles (BM 64/128), flash-decoding splits + the
combine, head dims 256 and 24, G = 1, 3 (padded head rows) and 8. Caches are NaN-poisoned outside the stored
positions and pages are randomly permuted, so reading a wrong or unwritten position fails."""
from __future__ import annotations

import math

import pytest
import torch

from gdnserve.ops.attention import paged_attention
from gdnserve.ops.attention.flash_triton import Config, choose_config, flash_attention_triton
from gdnserve.ops.attention.naive import naive_attention
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
I32 = torch.int32
NAN = float("nan")


def build(seqs, KVH, G, Dh, P, dtype, device, pad_rows=2, kv_start=0):
    """seqs: (context before the queries, Lq); (0, 0) is a padding sequence. Returns the op's inputs, the
    per-sequence contiguous K/V and the NaN-filled output (pad_rows extra rows never written)."""
    QH = G * KVH
    need = [math.ceil((c + L) / P) for c, L in seqs]
    perm = torch.randperm(sum(need) + 2).tolist()
    kc = torch.full((len(perm), P, KVH, Dh), NAN, dtype=dtype, device=device)
    vc = torch.full_like(kc, NAN)
    width = max(need) + 1
    table = torch.full((len(seqs), width), -1, dtype=I32)
    kv, cu = [], [0]
    for n, (c, L) in enumerate(seqs):
        pages = [perm.pop() for _ in range(need[n])]
        table[n, :need[n]] = torch.tensor(pages, dtype=I32)
        k = torch.randn(c + L, KVH, Dh, device=device).to(dtype)
        v = torch.randn(c + L, KVH, Dh, device=device).to(dtype)
        if kv_start and c + L:
            k[:kv_start], v[:kv_start] = NAN, NAN
        for p in range(c + L):
            kc[pages[p // P], p % P], vc[pages[p // P], p % P] = k[p], v[p]
        kv.append((k, v))
        cu.append(cu[-1] + L)
    T = cu[-1]
    q = torch.randn(T + pad_rows, QH, Dh, device=device).to(dtype)
    out = torch.full_like(q, NAN)
    lens = torch.tensor([c + L if L else 0 for c, L in seqs], dtype=I32, device=device)
    return q, kc, vc, torch.tensor(cu, dtype=I32, device=device), lens, table.to(device), kv, out


def check(seqs, q, out, cu, kv, dtype, scale, kv_start=0):
    for n, (c, L) in enumerate(seqs):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        if not L:
            continue
        k, v = kv[n]
        ref = naive_attention(q[rows], k[kv_start:], v[kv_start:], scale)
        err = rel_rms(out[rows], ref)
        assert err < TOL[dtype], f"sequence {n} (context {c}, Lq {L}): rel-RMS {err:.3g}"
    assert torch.isnan(out[int(cu[-1]):]).all(), "padding rows were written"


# (context, Lq): odd query lengths 1, 3, 65; a prefix in pages + a fresh part; a padding sequence
SEQS = [(0, 65), (40, 17), (0, 0), (29, 1), (70, 3), (0, 1)]


@pytest.mark.parametrize("G,Dh,dtype,cfg", [
    (8, 256, torch.bfloat16, Config(128, 64, 8, 2)),       # prefill tile: 16 queries x 8 heads
    (8, 256, torch.bfloat16, Config(16, 64, 4, 2)),        # decode tile: 2 queries x 8 heads
    (3, 24, torch.float32, Config(64, 32, 4, 2)),          # G = 3: one padded head row per query
    (1, 24, torch.float32, Config(32, 16, 4, 2)),          # no GQA
    (8, 256, torch.bfloat16, Config(16, 64, 4, 2, 64, 2)),  # flash-decoding: 2 pieces of 64 (one for short ones)
    (3, 24, torch.bfloat16, Config(64, 16, 4, 2, 32, 4)),  # splits with multi-row prefill blocks (BQ 16)
])
def test_flash_paths_match_reference(G, Dh, dtype, cfg, device):
    KVH, P = 2, 16 if Dh == 256 else 5
    scale = 0.8 * Dh ** -0.5
    q, kc, vc, cu, lens, table, kv, out = build(SEQS, KVH, G, Dh, P, dtype, device)
    T = int(cu[-1])
    flash_attention_triton(q[:T], kc, vc, cu, lens, table, scale, out[:T], max_q_len=65, config=cfg)
    check(SEQS, q, out, cu, kv, dtype, scale)


def test_many_pieces_merge(device):
    """More pieces than the merge loads at once (8): 16-position pieces over contexts up to 201, odd lengths, a
    padding sequence, decode and 2-row blocks."""
    seqs = [(150, 2), (29, 1), (0, 0), (200, 1), (64, 1)]
    G, KVH, Dh, P = 8, 2, 24, 5
    q, kc, vc, cu, lens, table, kv, out = build(seqs, KVH, G, Dh, P, torch.float32, device)
    cap = table.shape[1] * P
    T = int(cu[-1])
    cfg = Config(16, 16, 4, 2, 16, -(-cap // 16))
    flash_attention_triton(q[:T], kc, vc, cu, lens, table, Dh ** -0.5, out[:T], max_q_len=2, config=cfg)
    check(seqs, q, out, cu, kv, torch.float32, Dh ** -0.5)


@pytest.mark.parametrize("max_q", [4, None])
def test_default_configs_through_the_op(max_q, device):
    """paged_attention's own config choice on verify-like rows (max_q_len 4: a decode tile, split on the small
    interpreter grid) and on a prefill batch (max_q_len None = T), with kv_start = 1 (position 0 NaN)."""
    G, KVH, Dh, P = 4, 2, 32, 4
    seqs = [(9, 4), (30, 1), (0, 0), (2, 3)] if max_q else [(1, 33), (12, 7), (5, 1)]
    q, kc, vc, cu, lens, table, kv, out = build(seqs, KVH, G, Dh, P, torch.float32, device, kv_start=1)
    T = int(cu[-1])
    paged_attention(q[:T], kc, vc, cu, lens, table, scale=Dh ** -0.5, out=out[:T], kv_start=1, max_q_len=max_q,
                    backend="triton")
    check(seqs, q, out, cu, kv, torch.float32, Dh ** -0.5, kv_start=1)


def test_choose_config_from_shapes():
    """H200-like (132 SMs), Qwen3.5 attention (G 8, Dh 256, bf16): prefill gets 128-row tiles (64 when the
    grid would not fill the SMs), decode 16-row tiles, split only when the grid is small and the table wide."""
    big = choose_config(4096, 8, 256, 2, 4096, 1, 2, 132)
    assert (big.BM, big.n_split) == (128, 1)
    assert choose_config(512, 8, 256, 2, 512, 1, 2, 132).BM == 64
    d1 = choose_config(1, 8, 256, 2, 4096, 1, 2, 132)
    assert d1.BM == 16 and d1.n_split > 1 and d1.split % d1.BN == 0 and d1.split * d1.n_split >= 4096
    assert choose_config(1, 8, 256, 2, 4096, 256, 2, 132).n_split == 1
    assert choose_config(1, 8, 256, 2, 128, 1, 2, 132).n_split == 1
    assert choose_config(4, 8, 256, 2, 4096, 64, 2, 132).BM == 32


def test_rowwise_kernel_still_matches(device):
    """The first kernel (paged_triton.py; the benchmark's baseline) on the same batch."""
    from gdnserve.ops.attention.paged_triton import paged_attention_rowwise_triton
    q, kc, vc, cu, lens, table, kv, out = build(SEQS, 2, 3, 24, 5, torch.float32, device)
    T = int(cu[-1])
    paged_attention_rowwise_triton(q[:T], kc, vc, cu, lens, table, 24 ** -0.5, out[:T])
    check(SEQS, q, out, cu, kv, torch.float32, 24 ** -0.5)
