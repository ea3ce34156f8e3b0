"""The MoE router at the benchmark's shapes on the GPU against CUDA's torch.topk (GPU only: the CPU has no CUDA top-k
to compare with, and the interpreter would take minutes at these sizes). The kernels' semantics: test_router.py."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.moe.router import route
from tests.ops.test_router import W_TOL, check_alignment

pytestmark = pytest.mark.usefixtures("seed")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E", [(1, 256), (16, 64), (64, 256), (65, 64), (512, 256)])
def test_bench_shapes_against_cuda_topk(T, E, device):
    """The benchmark's router (hidden 2048, top-8, bf16 logits from the GEMM): on rows whose top-8 logits have
    no tie at the 8th place the ids equal CUDA torch.topk's (as a set, in weight order where weights differ);
    everywhere the chosen logit values are torch's; the alignment is align_pairs'. Each default launch shape
    (T = 1 small; 16, 64 one launch up to its limit; 65, 512 row blocks, 512 at the one-program alignment's limit)
    at both expert counts (the former T x E cross product compiled 12 variants)."""
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
