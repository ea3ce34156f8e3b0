"""Where the host time of one grouped prefill call goes (cProfile over repeated eager calls of
conv + chunk prefill for 1P512+16C64 and a decode call at B=1): python -m benchmarks.host_profile"""
import cProfile
import pstats
import time

import torch

from benchmarks.profile_kernels import prefill_case
from gdnserve.ops.gdn.recurrent import gdn_decode

H, HV, K, V = 16, 32, 128, 128


def main() -> None:
    dev = torch.device("cuda")
    bf = torch.bfloat16
    pool = torch.randn(4, HV, V, K, device=dev)
    s1 = torch.zeros(1, dtype=torch.int32, device=dev)
    q, k = torch.randn(1, H, K, device=dev, dtype=bf), torch.randn(1, H, K, device=dev, dtype=bf)
    v, a, b = torch.randn(1, HV, V, device=dev, dtype=bf), torch.randn(1, HV, device=dev, dtype=bf), torch.randn(1, HV, device=dev, dtype=bf)
    A_log, dt_bias, o = torch.zeros(HV, device=dev), torch.zeros(HV, device=dev), torch.empty(1, HV, V, device=dev, dtype=bf)
    cases = {"fused 1P512+16C64 (conv + chunk)": prefill_case([512] + [64] * 16, [-1] + [0] * 16, dev),
             "decode B=1": lambda: gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, s1, out=o)}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 300
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"## {name}: {dt:.1f} us host per call (no profiler)", flush=True)
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
