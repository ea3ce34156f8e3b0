"""GPU-only: CUDA-graph replay equals eager, bit for bit, for every launcher the engine will capture
(conv prefill + chunk prefill with a preallocated workspace, conv update, decode, replay verify), and
the chunked prefill at the real Qwen3.5 shape against our fp32 PyTorch path. Runs on the H200; CI skips."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.conv import causal_conv1d_prefill, causal_conv1d_update
from gdnserve.ops.gdn.chunk import ChunkWorkspace, chunk_gated_delta_rule
from gdnserve.ops.gdn.recurrent import GDNPending, gdn_decode, gdn_verify
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.varlen import VarlenMeta

pytestmark = pytest.mark.gpu
H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V


def capture(fn):
    """Warm up (compiles), capture one call, return the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def gates(dev):
    return torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), torch.rand(HV, device=dev)


def test_prefill_graph_equals_eager_real_shape():
    dev = torch.device("cuda")
    lens, parents = [700, 65, 130, 1], [-1, 0, 0, -1]
    T = sum(lens)
    meta = VarlenMeta.build(lens, dev)
    src = torch.tensor([3, -1, -1, 4], dtype=torch.int32, device=dev)
    dst = torch.tensor([5, 6, 7, 8], dtype=torch.int32, device=dev)
    par = torch.tensor(parents, dtype=torch.int32, device=dev)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(D, W, device=dev) * 0.5).to(torch.bfloat16)
    a = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    b = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    A_log, dt_bias = gates(dev)
    conv0 = torch.randn(10, W - 1, D, device=dev, dtype=torch.bfloat16)
    ssm0 = torch.randn(10, HV, V, K, device=dev) * 0.3
    conv, ssm = conv0.clone(), ssm0.clone()
    y = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
    o = torch.empty(T, HV, V, device=dev, dtype=torch.bfloat16)
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, torch.bfloat16, dev)

    def step():
        causal_conv1d_prefill(x, w, conv, meta, src, dst, par, out=y)
        q, k, v = y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V)
        chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, meta, src, dst, par, out=o, workspace=ws)

    g = capture(step)
    for pool, p0 in ((conv, conv0), (ssm, ssm0)):
        pool.copy_(p0)
    step()
    eager = (o.clone(), conv.clone(), ssm.clone(), y.clone())
    for pool, p0 in ((conv, conv0), (ssm, ssm0)):
        pool.copy_(p0)
    o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for got, want in zip((o, conv, ssm, y), eager):
        assert torch.equal(got, want)
    # the real shape against our fp32 PyTorch path (gdn_kernels.md §6.4: bf16 chunk 5e-3)
    ssm_ref = ssm0.clone()
    q, k, v = y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V)
    ref = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_ref, meta, src, dst, par, backend="torch")
    assert rel_rms(o, ref) < 5e-3
    assert rel_rms(ssm[5:9], ssm_ref[5:9]) < 5e-3


@pytest.mark.parametrize("B", [1, 256])
def test_decode_and_replay_verify_graph_equals_eager(B):
    dev = torch.device("cuda")
    L = 4
    S = 2 * B + 2
    slots = torch.randperm(S, device=dev)[:B].to(torch.int32)
    slots[-1] = -1
    A_log, dt_bias = gates(dev)
    qd, kd = torch.randn(B, H, K, device=dev, dtype=torch.bfloat16), torch.randn(B, H, K, device=dev, dtype=torch.bfloat16)
    vd = torch.randn(B, HV, V, device=dev, dtype=torch.bfloat16)
    ad, bd = torch.randn(B, HV, device=dev, dtype=torch.bfloat16), torch.randn(B, HV, device=dev, dtype=torch.bfloat16)
    q, k = torch.randn(B * L, H, K, device=dev, dtype=torch.bfloat16), torch.randn(B * L, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B * L, HV, V, device=dev, dtype=torch.bfloat16)
    a, b = torch.randn(B * L, HV, device=dev, dtype=torch.bfloat16), torch.randn(B * L, HV, device=dev, dtype=torch.bfloat16)
    x = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(D, W, device=dev) * 0.5).to(torch.bfloat16)
    pend = GDNPending.empty(2 * B, L, H, HV, K, V, torch.bfloat16, device=dev)
    for t in (pend.k, pend.v, pend.a, pend.b):
        t.copy_(torch.randn_like(t.float()).to(t.dtype))
    rows_in = torch.arange(B, device=dev, dtype=torch.int32)
    rows_out = rows_in + B
    num = torch.randint(0, L + 1, (B,), device=dev, dtype=torch.int32)
    ssm0 = torch.randn(S, HV, V, K, device=dev) * 0.3
    conv0 = torch.randn(S, W - 1, D, device=dev, dtype=torch.bfloat16)
    ssm, conv = ssm0.clone(), conv0.clone()
    od = torch.empty(B, HV, V, device=dev, dtype=torch.bfloat16)
    ov = torch.empty(B * L, HV, V, device=dev, dtype=torch.bfloat16)
    yd = torch.empty(B, D, device=dev, dtype=torch.bfloat16)

    def step():
        causal_conv1d_update(x, w, conv, slots, tokens_per_req=1, out=yd)
        gdn_decode(qd, kd, vd, ad, bd, A_log, dt_bias, ssm, slots, out=od)
        gdn_verify(q, k, v, a, b, A_log, dt_bias, ssm, slots, tokens_per_req=L, mode="replay", pending=pend,
                   pending_in_rows=rows_in, num_pending=num, pending_out_rows=rows_out, out=ov)

    pend_k0 = pend.k.clone()
    g = capture(step)
    ssm.copy_(ssm0); conv.copy_(conv0); pend.k.copy_(pend_k0)
    step()
    eager = (od.clone(), ov.clone(), yd.clone(), ssm.clone(), conv.clone(), pend.k.clone())
    ssm.copy_(ssm0); conv.copy_(conv0); pend.k.copy_(pend_k0)
    od.fill_(float("nan")); ov.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for got, want in zip((od, ov, yd, ssm, conv, pend.k), eager):
        assert torch.equal(got, want)
