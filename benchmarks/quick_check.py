"""Short GPU check for a nearly spent device budget: host cost of our launchers on the lean launch
path and GPU time of decode / replay verify / prefill, printed as it goes (python -m benchmarks.quick_check)."""
import time

import torch

from benchmarks.profile_kernels import decode_case, prefill_case, verify_case


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


dev = torch.device("cuda")
for B in (1, 256):
    dec, ver = decode_case(B, dev), verify_case(B, 4, "replay", dev)   # replay: 3 pending tokens
    print(f"B={B}: decode gpu {gpu_us(dec):.1f} us host {host_us(dec):.1f} us | replay verify L=4 (3 pending) "
          f"gpu {gpu_us(ver):.1f} us host {host_us(ver):.1f} us", flush=True)

for lens in ([256] * 64, [512] + [64] * 16, [32768]):
    N = len(lens)
    parents = [-1] + [0] * (N - 1) if N == 17 else None
    pre = prefill_case(lens, parents, dev)
    print(f"prefill {N}x{lens[-1]} (T={sum(lens)}, parents={parents is not None}): gpu {gpu_us(pre, 5):.1f} us "
          f"host {host_us(pre, 50):.1f} us (conv + 3 chunk launches)", flush=True)
