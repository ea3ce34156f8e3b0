"""The Triton paged-KV path (interpreter on CPU) against the PyTorch path and the float64 reference."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.attention import paged_attention, store_kv
from gdnserve.ops.attention.naive import naive_attention
from gdnserve.ops.numerics import rel_rms


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_attention_matches_reference(page_size, g, dtype, device):
    KVH, Dh = 2, 24
    QH = g * KVH
    # (context before this step, new query tokens): prefill chunks with/without context, decode rows, padding
    seqs = [(0, 37), (20, 9), (45, 1), (0, 0), (7, 1), (3, 18)]
    pages_per = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages).tolist()
    k_cache = torch.full((num_pages, page_size, KVH, Dh), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(max(pages_per), 1)
    table, cu, kv_lens = [], [0], []
    kv_full, q_rows = [], []
    for n, (c, L) in enumerate(seqs):
        pages = [perm.pop() for _ in range(pages_per[n])]
        table.append(pages + [0] * (width - len(pages)))
        k = torch.randn(c + L, KVH, Dh, device=device).to(dtype)
        v = torch.randn(c + L, KVH, Dh, device=device).to(dtype)
        if c + L:
            slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(c + L)],
                                 device=device)
            store_kv(k, v, k_cache, v_cache, slots, backend="triton")
        kv_full.append((k, v))
        q_rows.append(torch.randn(L, QH, Dh, device=device).to(dtype))
        cu.append(cu[-1] + L)
        kv_lens.append(c + L if L else 0)
    q = torch.cat(q_rows)
    T = q.shape[0]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    o = torch.full((T + 2, QH, Dh), float("nan"), dtype=dtype, device=device)[:T]
    paged_attention(q, k_cache, v_cache, i32(cu), i32(kv_lens), i32(table), scale=Dh ** -0.5, out=o,
                    backend="triton")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n, (c, L) in enumerate(seqs):
        if not L:
            continue
        ref = naive_attention(q_rows[n], *kv_full[n], Dh ** -0.5)
        assert rel_rms(o[cu[n]:cu[n + 1]], ref) < tol, f"sequence {n}"
    o_t = paged_attention(q, k_cache, v_cache, i32(cu), i32(kv_lens), i32(table), scale=Dh ** -0.5, backend="torch")
    assert rel_rms(o, o_t) < tol


def test_max_q_len_bounds_the_grid_not_the_result(device):
    """Decode / verify rows with max_q_len = their Lq: the same output as the default grid (max_q_len = T) up to
    fp32 summation order (the tile config, and on the GPU the flash-decoding split, follow max_q_len); max_q_len
    is validated at the boundary."""
    KVH, Dh, P, L = 2, 16, 4, 3
    lens = [5, 9, 3, 12, 4, 7, 20]                         # T = 21 > 16: the default grid has 2 query blocks
    width = max(-(-n // P) for n in lens)
    k_cache = torch.randn(len(lens) * width, P, KVH, Dh, device=device)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(len(lens) * width, dtype=torch.int32, device=device).view(len(lens), width)
    cu = torch.arange(0, (len(lens) + 1) * L, L, dtype=torch.int32, device=device)
    kv = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens) * L, 2 * KVH, Dh, device=device)
    want = paged_attention(q, k_cache, v_cache, cu, kv, table, scale=0.25, backend="triton")
    got = paged_attention(q, k_cache, v_cache, cu, kv, table, scale=0.25, max_q_len=L, backend="triton")
    assert rel_rms(got, want) < 1e-6
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_q_len"):
            paged_attention(q, k_cache, v_cache, cu, kv, table, scale=0.25, max_q_len=bad)
