"""Where a serving pass's time goes: the bench_serve RFC workload (1P600+10C, 16 groups at once) per mode with
per-step wall times (device synchronised), the number of new Triton launch-cache entries per step (a new entry
= a compile or a first specialisation), and a cProfile of the slowest pass.

    python -m benchmarks.serve_diag [--modes fused,two_phase,none]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from benchmarks import bench_serve as bs
from benchmarks.random_model import build_random_model, config_for
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.ops import launch as L


def timed_drive(engine, groups, mode, params, tag):
    """``bench_serve.drive`` with each engine step timed (device synchronised) and its new launch-cache entries
    counted: [(ms, new keys)] per step."""
    steps, step = [], engine.step

    def timed_step():
        n0 = len(L._compiled)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        steps.append((round((time.perf_counter() - t) * 1e3, 1), len(L._compiled) - n0))
        return out

    engine.step = timed_step
    try:
        bs.drive(engine, groups, mode, params, tag)
    finally:
        del engine.step
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="fused,two_phase,none")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_random_model(config_for(dev, None, None), dev, torch.bfloat16)
    plan = bs.make_plan(True, False, None)
    wl = plan.workloads[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for mode in a.modes.split(","):
        rng = random.Random(wl.prefix)
        engine = bs.make_engine(model, mode, plan)
        for i, n in enumerate([1, 1, 1, 16, 16, 16]):
            groups = wl.make_groups(n, 248320, rng)
            prof = cProfile.Profile() if i == 4 else None
            if prof:
                prof.enable()
            t = time.perf_counter()
            steps = timed_drive(engine, groups, mode, params, f"p{i}-")
            wall = time.perf_counter() - t
            if prof:
                prof.disable()
            print(f"{mode} pass {i} ({n} groups): {wall * 1e3:.0f} ms; steps (ms, new launch keys): {steps}; "
                  f"free pages {engine.runner.pages.num_free}", flush=True)
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print("\n".join(s.getvalue().splitlines()[:45]), flush=True)
        engine = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
