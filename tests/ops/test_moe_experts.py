"""Routed experts (ops/moe): the Triton grouped GEMM (CPU interpreter in CI, the GPU on the device) and the
PyTorch loop against the float64 reference; the alignment's invariants; a token's output independent of the
rest of the batch; padding blocks skipped; the layer on either backend."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe import moe_experts
from gdnserve.ops.moe.align import align_pairs, padded_rows
from gdnserve.ops.moe.naive import naive_moe_experts
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def case(T: int, H: int, I: int, E: int, k: int, dtype, device, skew: bool = False):
    x = torch.randn(T, H, device=device).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device=device) / H ** 0.5).to(dtype)
    dn = (torch.randn(E, H, I, device=device) / I ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=device)
    if skew:   # most tokens on expert 0: one long run, many empty experts
        logits[:, 0] += 10
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(dtype), idx, gu, dn


@pytest.mark.parametrize("T", [1, 5, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_against_float64(T, dtype, backend, device):
    x, w, idx, gu, dn = case(T, 48, 40, 8, 3, dtype, device)
    out = moe_experts(x, w, idx, gu, dn, backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_rms(out, naive_moe_experts(x, w, idx, gu, dn)) < TOL[dtype]


@pytest.mark.parametrize("k,E", [(1, 4), (4, 4), (2, 16)])
def test_triton_topk_shapes_and_skew(k, E, device):
    x, w, idx, gu, dn = case(23, 32, 24, E, k, torch.float32, device, skew=True)
    ref = naive_moe_experts(x, w, idx, gu, dn)
    assert rel_rms(moe_experts(x, w, idx, gu, dn, backend="triton"), ref) < TOL[torch.float32]


def test_bad_weights_are_refused(device):
    x, w, idx, gu, dn = case(4, 32, 16, 4, 2, torch.float32, device)
    with pytest.raises(ValueError, match="dtype"):
        moe_experts(x, w, idx, gu.double(), dn, backend="triton")
    with pytest.raises(ValueError, match="contiguous"):
        moe_experts(x, w, idx, gu.transpose(1, 2).contiguous().transpose(1, 2), dn, backend="triton")


def test_triton_strided_input_and_empty(device):
    x, w, idx, gu, dn = case(9, 32, 16, 4, 2, torch.float32, device)
    wide = torch.randn(9, 50, device=device)
    wide[:, 3:35] = x
    out = moe_experts(wide[:, 3:35], w, idx, gu, dn, backend="triton")
    assert rel_rms(out, naive_moe_experts(x, w, idx, gu, dn)) < TOL[torch.float32]
    z = moe_experts(x[:0], w[:0], idx[:0], gu, dn, backend="triton")
    assert z.shape == (0, 32)


def test_token_independent_of_batch(device):
    """A token's output is the same bits alone or inside a batch with other tokens of the same batch shape
    (the tile config follows T*k: batches of another size may round differently)."""
    x, w, idx, gu, dn = case(40, 32, 16, 4, 2, torch.bfloat16, device)
    full = moe_experts(x, w, idx, gu, dn, backend="triton")
    for t in (0, 17, 39):
        sub = torch.cat([x[t:t + 1], x[:3]])
        one = moe_experts(sub, torch.cat([w[t:t + 1], w[:3]]), torch.cat([idx[t:t + 1], idx[:3]]), gu, dn,
                          backend="triton")
        assert torch.equal(one[0], full[t])


@pytest.mark.parametrize("BM", [16, 64])
def test_alignment_invariants(BM, device):
    T, k, E = 50, 3, 8
    idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    al = align_pairs(idx, E, BM)
    N = T * k
    assert al.rows.numel() == padded_rows(N, E, BM) and al.rows.numel() % BM == 0
    rows, be = al.rows.cpu().long(), al.block_expert.cpu().long()
    real = rows[rows < N]
    assert sorted(real.tolist()) == list(range(N))                      # every pair exactly once
    flat = idx.flatten().cpu()
    for b in range(be.numel()):
        blk = rows[b * BM:(b + 1) * BM]
        blk = blk[blk < N]
        if be[b] < 0:
            assert blk.numel() == 0
        else:
            assert (flat[blk] == be[b]).all() and blk.numel() > 0     # one expert per block, no empty block
            assert torch.equal(blk, blk.sort().values)                # token order kept within an expert


def test_layer_backends_agree(device):
    from gdnserve.layers.moe import SparseMoE
    moe = SparseMoE(32, 8, 2, 16, 24, True).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    x = torch.randn(21, 32, device=device)
    moe.backend = "torch"
    a = moe(x)
    moe.backend = "triton"
    b = moe(x)
    assert rel_rms(b, a) < 2e-5


# (4096, 1, 63, 64): the one-program alignment at its MAX_PAIRS limit; (64, 8, 512, 16): 512 experts (a 1024-bin
# histogram) at an eighth of the pairs (it was (512, 8, 512, 16), a second 4096-pair sort: ~10 s interpreted)
@pytest.mark.parametrize("T,k,E,BM", [(1, 8, 64, 16), (3, 2, 4, 16), (37, 3, 8, 32), (50, 8, 256, 16), (64, 8, 64, 64),
                                      (9, 4, 15, 16), (40, 8, 63, 32), (16, 8, 511, 16), (64, 8, 512, 16),
                                      (4096, 1, 63, 64)])
def test_triton_alignment_equals_torch(T, k, E, BM, device):
    from gdnserve.ops.moe.align_triton import align_pairs_triton
    idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    if T > 10:
        idx[: T // 2, 0] = 1                       # a long run for one expert (a repeat within a row is fine here)
    a, b = align_pairs(idx, E, BM), align_pairs_triton(idx, E, BM)
    assert torch.equal(a.rows, b.rows) and torch.equal(a.block_expert, b.block_expert)
