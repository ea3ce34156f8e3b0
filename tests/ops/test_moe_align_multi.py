"""The multi-program expert alignment (ops/moe/align_multi: count + scatter, no sort) against ``align.align_pairs``
bit for bit, and its use above the one-program kernel's limit (``align_triton.MAX_PAIRS``) by the alignment
entry point, the router and the grouped GEMM. Small scan blocks reach several segments at interpreter sizes."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe import align_multi, align_triton
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe.align_multi import align_pairs_multi, segments
from gdnserve.ops.moe.grouped_triton import block_rows

pytestmark = pytest.mark.usefixtures("seed")


def same(a, b) -> None:
    assert a.BM == b.BM
    assert torch.equal(a.rows, b.rows) and torch.equal(a.block_expert, b.block_expert)


def distinct_ids(T: int, k: int, E: int, device) -> torch.Tensor:
    return torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]).to(torch.int32)


@pytest.mark.parametrize("T,k,E,BM,block", [(1, 1, 1, 16, 64), (7, 3, 5, 16, 64), (203, 3, 7, 32, 64),
                                            (131, 9, 17, 16, 128), (517, 2, 3, 64, 64), (90, 4, 33, 128, 64)])
def test_equals_align_pairs(T, k, E, BM, block, device):
    idx = distinct_ids(T, k, E, device)
    idx[: T // 2, 0] = E - 1                       # one long run (past a block) and experts with no pair
    same(align_pairs_multi(idx, E, BM, block=block), align_pairs(idx, E, BM))


def test_repeats_int64_and_strided(device):
    """Repeated experts within a row keep pair order; int64 and non-contiguous ids are read as given."""
    idx = torch.randint(0, 6, (300, 4), device=device)
    same(align_pairs_multi(idx, 6, 16, block=64), align_pairs(idx, 6, 16))
    wide = torch.randint(0, 6, (150, 8), device=device)[:, ::2]
    same(align_pairs_multi(wide, 6, 32, block=64), align_pairs(wide.contiguous(), 6, 32))


def test_no_pairs(device):
    al = align_pairs_multi(torch.empty(0, 3, dtype=torch.int32, device=device), 4, 16)
    assert al.rows.numel() == 0 and al.block_expert.numel() == 0


def test_segments_cover_every_pair():
    for n in (1, 4095, 8192, 8193, 36864, 73728, 1 << 20):
        seg, s = segments(n)
        assert seg % align_multi.BLOCK == 0 and s <= align_multi.MAX_SEGMENTS and (s - 1) * seg < n <= s * seg


def test_entry_point_hands_large_counts_over(monkeypatch, device):
    """align_pairs_triton above MAX_PAIRS, the router's row-block launch and moe_experts all take the
    multi-program alignment and agree with align_pairs."""
    from gdnserve.ops.moe import experts as experts_mod, router_triton
    from gdnserve.ops.moe.router import route
    monkeypatch.setattr(align_triton, "MAX_PAIRS", 16)
    monkeypatch.setattr(router_triton, "MAX_PAIRS", 16)
    calls = []
    orig = align_triton.align_pairs_multi
    monkeypatch.setattr(align_triton, "align_pairs_multi", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    idx = distinct_ids(70, 3, 9, device)
    same(align_triton.align_pairs_triton(idx, 9, 16), align_pairs(idx, 9, 16))
    logits = torch.randn(70, 9, device=device)
    r = route(logits, 3, True, backend="triton")
    same(r.alignment, align_pairs(r.experts, 9, block_rows(r.experts.numel(), 9)))
    x = torch.randn(70, 32, device=device)
    gu, dn = torch.randn(9, 24, 32, device=device) / 6, torch.randn(9, 32, 12, device=device) / 4
    got = experts_mod.moe_experts(x, r.weights, r.experts, gu, dn, backend="triton")
    want = experts_mod.moe_experts(x, r.weights, r.experts, gu, dn, backend="triton", alignment=r.alignment)
    assert torch.equal(got, want) and len(calls) == 3
