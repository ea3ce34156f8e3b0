"""The MoE router (ops/moe/router): the Triton kernels (the three launch shapes; CPU interpreter in CI) against the
PyTorch path (HF's ops), the float64 reference and ``align.align_pairs``; ties go to the lower expert id. The
benchmark's shapes against CUDA's top-k: test_router_gpu.py."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe import router_triton
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe.grouped_triton import block_rows
from gdnserve.ops.moe.router import route
from gdnserve.ops.moe.router_naive import naive_route
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
# weights vs the PyTorch path (relative; GPU exp approx). bf16: one ulp, 2^-7 relative at worst (just above a power
# of two; 2^-8 failed the H200 on a 1-ulp difference, test_bench_shapes_against_cuda_topk[256-512] at 2971824)
W_TOL = {torch.float32: 4e-6, torch.bfloat16: 2.0 ** -7}


LAUNCH_SHAPES = ("small", "one_launch", "row_blocks")
# One (T, E, k, renorm) per launch shape, shared by the fp32, bf16-ties and shared-column tests so that a GPU run
# compiles each launch shape's kernels once per dtype (the former shapes x launch shapes cross products compiled
# ~60 variants, 426 s on the H200). small: one row block, E no power of two, top-8, no renormalisation;
# one_launch: two row blocks of 64 (renormalised); row_blocks: two row programs (E a power of two).
CASES = {"small": (3, 60, 8, False), "one_launch": (65, 60, 3, True), "row_blocks": (65, 64, 2, False)}


def force(launch_shape: str, monkeypatch) -> None:
    """Force the one-program in-register alignment (where the rows fit one row block), the single-program
    fused kernel, or the row-parallel kernel + alignment launch."""
    monkeypatch.setattr(router_triton, "SMALL_PAIRS", 1 << 20 if launch_shape == "small" else 0)
    monkeypatch.setattr(router_triton, "FUSED_MAX_TOKENS", 1 << 20 if launch_shape == "one_launch" else 0)


def check_alignment(r, E: int) -> None:
    want = align_pairs(r.experts, E, block_rows(r.experts.numel(), E))
    assert r.alignment.BM == want.BM
    assert torch.equal(r.alignment.rows, want.rows) and torch.equal(r.alignment.block_expert, want.block_expert)


# each launch shape's case, and k = 1 of E = 8 (< the 16-column minimum tile) on one row in the small path
@pytest.mark.parametrize("launch_shape,T,E,k,renorm", [(ls, *CASES[ls]) for ls in LAUNCH_SHAPES]
                         + [("small", 1, 8, 1, True)])
def test_fp32_logits_equal_torch(launch_shape, T, E, k, renorm, device, monkeypatch):
    """fp32 logits (no ties): the same ids in the same order as torch.topk; weights to fp32 rounding."""
    force(launch_shape, monkeypatch)
    logits = torch.randn(T, E, device=device) * 2
    got = route(logits, k, renorm, backend="triton")
    w, idx = route(logits, k, renorm, backend="torch")[:2]
    assert got.experts.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert torch.equal(got.experts.long(), idx)
    torch.testing.assert_close(got.weights, w, rtol=W_TOL[torch.float32], atol=1e-7)
    ref_w, ref_idx = naive_route(logits, k, renorm)
    assert torch.equal(got.experts.long(), ref_idx) and rel_rms(got.weights, ref_w) < 2e-6
    check_alignment(got, E)


@pytest.mark.parametrize("launch_shape", LAUNCH_SHAPES)
def test_bf16_logits_with_ties(launch_shape, device, monkeypatch):
    """bf16 logits of a narrow spread (many equal values): ids by (logit desc, id asc) as the reference; the
    weights torch returns (its tie order is unspecified on the CPU) are the same multiset; alignment exact."""
    force(launch_shape, monkeypatch)
    T, E, k, renorm = CASES[launch_shape]
    logits = (torch.randn(T, E, device=device) * 0.05).to(torch.bfloat16)
    got = route(logits, k, renorm, backend="triton")
    assert got.weights.dtype == torch.bfloat16
    ref_w, ref_idx = naive_route(logits, k, renorm)
    assert torch.equal(got.experts.long(), ref_idx)
    w, idx = route(logits, k, renorm, backend="torch")[:2]
    torch.testing.assert_close(got.weights.float(), w.float(), rtol=W_TOL[torch.bfloat16], atol=0)
    assert rel_rms(got.weights, ref_w) < 4e-3
    # the chosen set: torch's top-k logits equal ours value for value (ties may pick other ids)
    assert torch.equal(torch.gather(logits, 1, idx), torch.gather(logits, 1, got.experts.long()))
    check_alignment(got, E)


def test_odd_strides_and_empty(device):
    wide = torch.randn(5, 40, device=device)
    logits = wide[:, 3:33]                        # row stride 40, E = 30
    got = route(logits, 3, True, backend="triton")
    assert torch.equal(got.experts.long(), route(logits.contiguous(), 3, True, backend="torch").experts)
    empty = route(logits[:0], 3, True, backend="triton")
    assert empty.experts.shape == (0, 3) and empty.alignment.rows.numel() == 0
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 31, True, backend="triton")


# each launch shape's case, bf16 where its plain routing is test_bf16_logits_with_ties' (one_launch: fp32's), and
# k = 1 of E = 8 in fp32 on one row: the plain routings below are the other tests' launches
@pytest.mark.parametrize("launch_shape,T,E,k,renorm,dtype", [
    ("small", *CASES["small"], torch.bfloat16), ("one_launch", *CASES["one_launch"], torch.float32),
    ("row_blocks", *CASES["row_blocks"], torch.bfloat16), ("small", 1, 8, 1, True, torch.float32)])
def test_shared_column_becomes_pair_k(launch_shape, T, E, k, renorm, dtype, device, monkeypatch):
    """``shared=True``: column E (the shared expert's gate logit) is not routed; each token's pair k is
    (expert E, sigmoid(logit) in the logits' dtype); the alignment counts E+1 experts and k+1 pairs."""
    force(launch_shape, monkeypatch)
    logits = (torch.randn(T, E + 1, device=device) * 2).to(dtype)
    got = route(logits, k, renorm, backend="triton", shared=True)
    assert got.weights.shape == got.experts.shape == (T, k + 1) and got.weights.dtype == dtype
    plain = route(logits[:, :E].contiguous(), k, renorm, backend="triton")
    assert torch.equal(got.experts[:, :k], plain.experts) and torch.equal(got.weights[:, :k], plain.weights)
    assert (got.experts[:, k] == E).all()
    torch.testing.assert_close(got.weights[:, k], torch.sigmoid(logits[:, E]), rtol=W_TOL[dtype], atol=0)
    w, idx = route(logits, k, renorm, backend="torch", shared=True)[:2]
    assert idx.shape == (T, k + 1) and (idx[:, k] == E).all() and torch.equal(w[:, k], torch.sigmoid(logits[:, E]))
    if dtype == torch.float32:
        assert torch.equal(got.experts.long(), idx)
    check_alignment(got, E + 1)


@pytest.mark.parametrize("T,dtype", [(1, torch.bfloat16), (2, torch.float16), (7, torch.float32)])
def test_decode_shape_small_path(T, dtype, device):
    """The model's decode router (256 experts top-8 + the shared column) takes the one-program in-register
    alignment by default; ids by (logit desc, id asc), weights to rounding, alignment = align_pairs'. Logits
    all <= 0 but one, with exact zeros of both signs: +0 and -0 tie (the lower id first). One row (one warp),
    two (two warps) and seven (an 8-row block, part empty), each in another dtype."""
    E, k = 256, 8
    assert T * 16 <= router_triton.SMALL_PAIRS
    logits = (-torch.randn(T, E + 1, device=device).abs() * 0.05).to(dtype)
    logits[:, 5:40:3] = 0.0
    logits[:, 6:40:3] = -0.0
    logits[:, 100] = 3.0                      # one clear winner, then ties at +-0
    got = route(logits, k, True, backend="triton", shared=True)
    ref_w, ref_idx = naive_route(logits[:, :E], k, True)
    assert torch.equal(got.experts[:, :k].long(), ref_idx) and (got.experts[:, k] == E).all()
    assert rel_rms(got.weights[:, :k], ref_w) < (2e-6 if dtype == torch.float32 else 4e-3)
    check_alignment(got, E + 1)
