"""Where the host time of one grouped prefill call goes (cProfile over repeated eager calls of
conv + chunk prefill for 1P512+16C64 and a decode call at B=1): python -m benchmarks.host_profile"""
import cProfile
import pstats
import time

import torch

from benchmarks.profile_kernels import decode_case, prefill_case


def main() -> None:
    dev = torch.device("cuda")
    cases = {"fused 1P512+16C64 (conv + chunk)": prefill_case([512] + [64] * 16, [-1] + [0] * 16, dev),
             "decode B=1": decode_case(1, dev)}
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
