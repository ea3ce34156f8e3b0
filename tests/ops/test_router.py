"""The MoE router (ops/moe/router): the Triton kernels (both launch shapes; CPU interpreter in CI) against the
PyTorch path (HF's ops), the float64 reference and ``align.align_pairs``; ties go to the lower expert id."""
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


@pytest.fixture(params=["small", "one_launch", "row_blocks"])
def launch_shape(request, monkeypatch):
    """Force the one-program in-register alignment (where the rows fit one row block), the single-program
    fused kernel, or the row-parallel kernel + alignment launch."""
    monkeypatch.setattr(router_triton, "SMALL_PAIRS", 1 << 20 if request.param == "small" else 0)
    monkeypatch.setattr(router_triton, "FUSED_MAX_TOKENS", 1 << 20 if request.param == "one_launch" else 0)
    return request.param


def skip_unless_small_applies(launch_shape: str, T: int) -> None:
    """The in-register path serves one row block only; past it "small" would rerun the one_launch case."""
    if launch_shape == "small" and T > 8:
        pytest.skip("more rows than one row block of the in-register path")


def check_alignment(r, E: int) -> None:
    want = align_pairs(r.experts, E, block_rows(r.experts.numel(), E))
    assert r.alignment.BM == want.BM
    assert torch.equal(r.alignment.rows, want.rows) and torch.equal(r.alignment.block_expert, want.block_expert)


@pytest.mark.parametrize("T,E,k,renorm", [(1, 8, 1, True), (3, 60, 8, False), (3, 64, 2, True), (65, 60, 3, True),
                                          (65, 64, 2, False)])
def test_fp32_logits_equal_torch(T, E, k, renorm, launch_shape, device):
    """fp32 logits (no ties): the same ids in the same order as torch.topk; weights to fp32 rounding."""
    skip_unless_small_applies(launch_shape, T)
    logits = torch.randn(T, E, device=device) * 2
    got = route(logits, k, renorm, backend="triton")
    w, idx = route(logits, k, renorm, backend="torch")[:2]
    assert got.experts.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert torch.equal(got.experts.long(), idx)
    torch.testing.assert_close(got.weights, w, rtol=W_TOL[torch.float32], atol=1e-7)
    ref_w, ref_idx = naive_route(logits, k, renorm)
    assert torch.equal(got.experts.long(), ref_idx) and rel_rms(got.weights, ref_w) < 2e-6
    check_alignment(got, E)


@pytest.mark.parametrize("T,E,k", [(3, 60, 8), (65, 64, 4)])
def test_bf16_logits_with_ties(T, E, k, launch_shape, device):
    """bf16 logits of a narrow spread (many equal values): ids by (logit desc, id asc) as the reference; the
    weights torch returns (its tie order is unspecified on the CPU) are the same multiset; alignment exact."""
    skip_unless_small_applies(launch_shape, T)
    logits = (torch.randn(T, E, device=device) * 0.05).to(torch.bfloat16)
    got = route(logits, k, True, backend="triton")
    assert got.weights.dtype == torch.bfloat16
    ref_w, ref_idx = naive_route(logits, k, True)
    assert torch.equal(got.experts.long(), ref_idx)
    w, idx = route(logits, k, True, backend="torch")[:2]
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


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 65, 256, 512])
@pytest.mark.parametrize("E", [64, 256])
def test_bench_shapes_against_cuda_topk(T, E, device):
    """The benchmark's router (hidden 2048, top-8, bf16 logits from the GEMM): on rows whose top-8 logits have
    no tie at the 8th place the ids equal CUDA torch.topk's (as a set, in weight order where weights differ);
    everywhere the chosen logit values are torch's; the alignment is align_pairs'."""
    x = torch.randn(T, 2048, device=device, dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(x, (torch.randn(E, 2048, device=device) * 0.02).to(torch.bfloat16))
    got = route(logits, 8, True, backend="triton")
    w, idx = route(logits, 8, True, backend="torch")[:2]
    assert torch.equal(torch.gather(logits, 1, idx), torch.gather(logits, 1, got.experts.long()))
    srt = torch.sort(logits.float(), dim=1, descending=True).values
    clean = srt[:, 7] != srt[:, 8]
    assert torch.equal(got.experts.long()[clean].sort(1).values, idx[clean].sort(1).values)
    torch.testing.assert_close(got.weights.float(), w.float(), rtol=W_TOL[torch.bfloat16], atol=0)
    check_alignment(got, E)


@pytest.mark.parametrize("T,E,k,renorm,dtype", [(1, 8, 2, True, torch.float32), (3, 60, 8, False, torch.bfloat16),
                                                (65, 20, 3, True, torch.float32), (30, 7, 6, False, torch.bfloat16)])
def test_shared_column_becomes_pair_k(T, E, k, renorm, dtype, launch_shape, device):
    """``shared=True``: column E (the shared expert's gate logit) is not routed; each token's pair k is
    (expert E, sigmoid(logit) in the logits' dtype); the alignment counts E+1 experts and k+1 pairs."""
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


@pytest.mark.parametrize("T,dtype", [(1, torch.bfloat16), (2, torch.float16), (7, torch.bfloat16), (5, torch.float32)])
def test_decode_shape_small_path(T, dtype, device):
    """The model's decode router (256 experts top-8 + the shared column) takes the one-program in-register
    alignment by default; ids by (logit desc, id asc), weights to rounding, alignment = align_pairs'. Logits
    all <= 0 but one, with exact zeros of both signs: +0 and -0 tie (the lower id first)."""
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
