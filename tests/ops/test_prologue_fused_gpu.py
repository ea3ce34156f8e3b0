"""The one-launch attention prologue (qk_rope_store) and norm + router GEMV (add_rms_norm_gemv) on a GPU at the
real model's shapes (16 q / 2 KV heads x 256, rotary 64; router 257 x 2048): an eager call and a CUDA-graph
replay give the same bits, and both match the launches they replace."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.attention import store_kv
from gdnserve.ops.attention.qk_rope_store import qk_rope_store
from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.gemv import skinny_linear
from gdnserve.ops.gemv.norm_gemv import add_rms_norm_gemv
from gdnserve.ops.gemv.skinny_triton import TABLE
from gdnserve.ops.norm import rms_norm
from gdnserve.ops.numerics import rel_rms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


def graph_equals_eager(call, outs):
    """outs(): the tensors a call writes; compares a graph replay's with the eager call's."""
    call()
    eager = [t.clone() for t in outs()]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, outs()):
        assert torch.equal(a, b)


def test_qk_rope_store_graph_and_three_launches():
    T, QH, KVH, Dh, half = 4, 16, 2, 256, 32
    qkv = torch.randn(T, 2 * QH * Dh + 2 * KVH * Dh, device="cuda").to(BF16)
    q = qkv[:, :2 * QH * Dh].view(T, QH, 2 * Dh)[..., :Dh]
    k = qkv[:, 2 * QH * Dh:2 * QH * Dh + KVH * Dh].view(T, KVH, Dh)
    v = qkv[:, 2 * QH * Dh + KVH * Dh:].view(T, KVH, Dh)
    wq, wk = (0.1 * torch.randn(Dh, device="cuda")).to(BF16), (0.1 * torch.randn(Dh, device="cuda")).to(BF16)
    pos = torch.randint(0, 4000, (T,), device="cuda")
    inv = 1.0 / (1e7 ** (torch.arange(0, 2 * half, 2, device="cuda").float() / (2 * half)))
    kc, vc = torch.zeros(8, 16, KVH, Dh, device="cuda", dtype=BF16), torch.zeros(8, 16, KVH, Dh, device="cuda",
                                                                                  dtype=BF16)
    slots = torch.tensor([3, -1, 77, 100], device="cuda")
    res = {}

    def call():
        res["q"] = qk_rope_store(q, k, v, wq, wk, 1e-6, pos, inv, kc, vc, slots)
    graph_equals_eager(call, lambda: (res["q"], kc, vc))
    kc3, vc3 = torch.zeros_like(kc), torch.zeros_like(vc)
    q3 = rms_norm_rope(q, wq, 1e-6, pos, inv, backend="triton")
    store_kv(rms_norm_rope(k, wk, 1e-6, pos, inv, backend="triton"), v, kc3, vc3, slots, backend="triton")
    assert rel_rms(res["q"].float(), q3.float()) < 4e-3 and rel_rms(kc.float(), kc3.float()) < 4e-3
    assert torch.equal(vc, vc3)


def test_norm_router_graph_and_two_launches():
    N, K = 257, 2048
    h, r = torch.randn(1, K, device="cuda").to(BF16), torch.randn(1, K, device="cuda").to(BF16)
    nw, w = (0.1 * torch.randn(K, device="cuda")).to(BF16), (0.02 * torch.randn(N, K, device="cuda")).to(BF16)
    res = {}

    def call():
        res["y"], res["x"], res["s"] = add_rms_norm_gemv(h, r, nw, 1e-6, w)
    graph_equals_eager(call, lambda: (res["y"], res["x"], res["s"]))
    x2, s2 = rms_norm(h, nw, 1e-6, r, backend="triton")
    y2 = skinny_linear(x2, w, TABLE[(N, K)][0][1])
    assert torch.equal(res["s"], s2)
    assert rel_rms(res["x"].float(), x2.float()) < 4e-3 and rel_rms(res["y"].float(), y2.float()) < 4e-3


def test_norm_router_routing_graph_and_route_triton():
    """The routing by the last program: eager == replay (counter back at 0 after each), == route_triton on the
    launch's own logits (experts, weights, alignment) at the real router shape (256 + shared, top-8)."""
    from gdnserve.ops.gemv.norm_gemv import add_rms_norm_gemv_route, new_counter
    from gdnserve.ops.moe.router import route
    N, K = 257, 2048
    h, r = torch.randn(1, K, device="cuda").to(BF16), torch.randn(1, K, device="cuda").to(BF16)
    nw, w = (0.1 * torch.randn(K, device="cuda")).to(BF16), (0.05 * torch.randn(N, K, device="cuda")).to(BF16)
    cnt, res = new_counter("cuda"), {}

    def call():
        res["r"], res["x"], res["s"] = add_rms_norm_gemv_route(h, r, nw, 1e-6, w, cnt, 8, True, True)
    graph_equals_eager(call, lambda: (res["r"].weights, res["r"].experts, res["r"].alignment.rows,
                                      res["r"].alignment.block_expert, res["x"], res["s"]))
    assert int(cnt.item()) == 0
    y, _, _ = add_rms_norm_gemv(h, r, nw, 1e-6, w)
    r2 = route(y, 8, True, "triton", shared=True)
    assert torch.equal(res["r"].experts, r2.experts)
    assert rel_rms(res["r"].weights.float(), r2.weights.float()) < 1e-2
    assert torch.equal(res["r"].alignment.rows, r2.alignment.rows)
    assert torch.equal(res["r"].alignment.block_expert, r2.alignment.block_expert)
