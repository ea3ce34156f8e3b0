"""Short GPU check for a nearly spent device budget: host cost of our launchers on the lean launch
path and GPU time of decode / replay verify / prefill, printed as it goes (python -m benchmarks.quick_check)."""
import time

import torch

from gdnserve.ops.conv import causal_conv1d_prefill
from gdnserve.ops.gdn.chunk import ChunkWorkspace, chunk_gated_delta_rule
from gdnserve.ops.gdn.recurrent import GDNPending, gdn_decode, gdn_verify
from gdnserve.ops.varlen import VarlenMeta

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V
dev = torch.device("cuda")
bf = torch.bfloat16


def gpu_us(fn, n=20):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n


def host_us(fn, n=200):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


A_log, dt_bias = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), torch.rand(HV, device=dev)
for B in (1, 256):
    L = 4
    pool = torch.randn(2 * B + 1, HV, V, K, device=dev) * 0.1
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    qd, kd = torch.randn(B, H, K, device=dev, dtype=bf), torch.randn(B, H, K, device=dev, dtype=bf)
    vd, ad, bd = torch.randn(B, HV, V, device=dev, dtype=bf), torch.randn(B, HV, device=dev, dtype=bf), torch.randn(B, HV, device=dev, dtype=bf)
    od = torch.empty(B, HV, V, device=dev, dtype=bf)
    dec = lambda: gdn_decode(qd, kd, vd, ad, bd, A_log, dt_bias, pool, slots, out=od)  # noqa: E731
    q, k = torch.randn(B * L, H, K, device=dev, dtype=bf), torch.randn(B * L, H, K, device=dev, dtype=bf)
    v, a, b = torch.randn(B * L, HV, V, device=dev, dtype=bf), torch.randn(B * L, HV, device=dev, dtype=bf), torch.randn(B * L, HV, device=dev, dtype=bf)
    pend = GDNPending.empty(2 * B, L, H, HV, K, V, bf, dev)
    rin, rout = slots, slots + B
    num = torch.full((B,), 3, dtype=torch.int32, device=dev)
    ov = torch.empty(B * L, HV, V, device=dev, dtype=bf)
    ver = lambda: gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, tokens_per_req=L, mode="replay",  # noqa: E731
                             pending=pend, pending_in_rows=rin, num_pending=num, pending_out_rows=rout, out=ov)
    print(f"B={B}: decode gpu {gpu_us(dec):.1f} us host {host_us(dec):.1f} us | replay verify L=4 (3 pending) "
          f"gpu {gpu_us(ver):.1f} us host {host_us(ver):.1f} us", flush=True)

for lens in ([256] * 64, [512] + [64] * 16, [32768]):
    T, N = sum(lens), len(lens)
    meta = VarlenMeta.build(lens, dev)
    x = torch.randn(T, D, device=dev, dtype=bf)
    w = torch.randn(D, W, device=dev, dtype=bf)
    a, b = torch.randn(T, HV, device=dev, dtype=bf), torch.randn(T, HV, device=dev, dtype=bf)
    conv = torch.randn(N + 1, W - 1, D, device=dev, dtype=bf)
    ssm = torch.randn(N + 1, HV, V, K, device=dev) * 0.1
    src = torch.arange(N, dtype=torch.int32, device=dev)
    par = torch.tensor([-1] + [0] * (N - 1), dtype=torch.int32, device=dev) if N == 17 else None
    dst = src + 1 if par is not None else src     # a parent's source slot is written by nobody
    y = torch.empty(T, D, device=dev, dtype=bf)
    o = torch.empty(T, HV, V, device=dev, dtype=bf)
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, bf, dev)

    def pre():
        causal_conv1d_prefill(x, w, conv, meta, src, dst, par, out=y)
        chunk_gated_delta_rule(y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K),
                               y[:, 2 * H * K:].view(T, HV, V), a, b, A_log, dt_bias, ssm, meta, src, dst, par,
                               out=o, workspace=ws)
    print(f"prefill {N}x{lens[-1]} (T={T}, parents={par is not None}): gpu {gpu_us(pre, 5):.1f} us "
          f"host {host_us(pre, 50):.1f} us (conv + 3 chunk launches)", flush=True)
