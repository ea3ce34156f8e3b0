"""Per-kernel GPU time of our GDN ops on the Qwen3.5-35B-A3B GDN shape (torch.profiler), so a
missed target can be traced to a stage: python -m benchmarks.profile_kernels [--cases A,B] [--host].
--host adds where the host time of one eager call goes (perf_counter over 300 calls, then cProfile's top
entries). Launch configs are compared by benchmarks/tune_chunk.py (prefill) and bench_ops' variant rows
(decode/verify), not by patching kernel constants here."""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gdnserve.ops.conv import causal_conv1d_prefill
from gdnserve.ops.gdn.chunk import ChunkWorkspace, chunk_gated_delta_rule
from gdnserve.ops.gdn.recurrent import GDNPending, gdn_decode, gdn_verify
from gdnserve.ops.varlen import VarlenMeta

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V
bf = torch.bfloat16


def kernel_table(fn, reps: int = 10) -> list[tuple[str, float, int]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:60]].append(e.device_time)
    return sorted(((n, sum(t) / reps, len(t) // reps) for n, t in tot.items()), key=lambda r: -r[1])


def prefill_case(lens, parents, dev):
    T, N = sum(lens), len(lens)
    meta = VarlenMeta.build(lens, dev)
    x = torch.randn(T, D, device=dev, dtype=bf)
    w = torch.randn(D, W, device=dev, dtype=bf)
    a, b = torch.randn(T, HV, device=dev, dtype=bf), torch.randn(T, HV, device=dev, dtype=bf)
    A_log, dt_bias = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), torch.rand(HV, device=dev)
    conv = torch.randn(N + 1, W - 1, D, device=dev, dtype=bf)
    ssm = torch.randn(N + 1, HV, V, K, device=dev) * 0.1
    src = torch.arange(N, dtype=torch.int32, device=dev)
    par = None
    if parents:
        par = torch.tensor([-1 if p < 0 else p for p in parents], dtype=torch.int32, device=dev)
    dst = src + 1 if par is not None else src
    y = torch.empty(T, D, device=dev, dtype=bf)
    o = torch.empty(T, HV, V, device=dev, dtype=bf)
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, bf, dev)

    def run():
        causal_conv1d_prefill(x, w, conv, meta, src, dst, par, out=y)
        chunk_gated_delta_rule(y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K),
                               y[:, 2 * H * K:].view(T, HV, V), a, b, A_log, dt_bias, ssm, meta, src, dst, par,
                               out=o, workspace=ws)
    return run


def decode_case(B, dev):
    A_log, dt_bias = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), torch.rand(HV, device=dev)
    pool = torch.randn(2 * B + 1, HV, V, K, device=dev) * 0.1
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    q, k = torch.randn(B, H, K, device=dev, dtype=bf), torch.randn(B, H, K, device=dev, dtype=bf)
    v = torch.randn(B, HV, V, device=dev, dtype=bf)
    a, b = torch.randn(B, HV, device=dev, dtype=bf), torch.randn(B, HV, device=dev, dtype=bf)
    o = torch.empty(B, HV, V, device=dev, dtype=bf)
    return lambda: gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, out=o)


def verify_case(B, L, mode, dev):
    A_log, dt_bias = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), torch.rand(HV, device=dev)
    pool = torch.randn(2 * B + 1, HV, V, K, device=dev) * 0.1
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    q, k = torch.randn(B * L, H, K, device=dev, dtype=bf), torch.randn(B * L, H, K, device=dev, dtype=bf)
    v = torch.randn(B * L, HV, V, device=dev, dtype=bf)
    a, b = torch.randn(B * L, HV, device=dev, dtype=bf), torch.randn(B * L, HV, device=dev, dtype=bf)
    ov = torch.empty(B * L, HV, V, device=dev, dtype=bf)
    if mode == "replay":
        pend = GDNPending.empty(2 * B, L, H, HV, K, V, bf, dev)
        num = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
        return lambda: gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, tokens_per_req=L, mode="replay",
                                  pending=pend, pending_in_rows=slots, num_pending=num, pending_out_rows=slots + B,
                                  out=ov)
    scratch = torch.empty(B, L, HV, V, K, device=dev)
    return lambda: gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, tokens_per_req=L, mode="intermediate",
                              scratch=scratch, scratch_rows=slots, out=ov)


def host_profile(name: str, fn, n: int = 300) -> None:
    """Mean host µs of one eager call (GPU idle at the start of the loop), then cProfile's top entries."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
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
    print(f"## host {name}: {dt:.1f} us per call (no profiler)", flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


CASES = {
    "decode B=1": lambda dev: decode_case(1, dev),
    "fused 1P512+16C64": lambda dev: prefill_case([512] + [64] * 16, [-1] + [0] * 16, dev),
    "fused 1P4096+64C256": lambda dev: prefill_case([4096] + [256] * 64, [-1] + [0] * 64, dev),
    "plain 1x576": lambda dev: prefill_case([576], None, dev),
    "prefill 1x32768": lambda dev: prefill_case([32768], None, dev),
    "prefill 64x256": lambda dev: prefill_case([256] * 64, None, dev),
    "verify replay B=256 L=4": lambda dev: verify_case(256, 4, "replay", dev),
    "verify intermediate B=256 L=4": lambda dev: verify_case(256, 4, "intermediate", dev),
}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--host", action="store_true", help="also profile the host time of one eager call per case")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name in args.cases.split(","):
        if name not in CASES:
            ap.error(f"--cases: unknown case {name!r}")
        fn = CASES[name](dev)
        if args.host:
            host_profile(name, fn)
        rows = kernel_table(fn)
        total = sum(t for _, t, _ in rows)
        print(f"## {name}: {total:.1f} us GPU per call", flush=True)
        for n, t, c in rows:
            print(f"   {t:9.1f} us  x{c}  {n}", flush=True)


if __name__ == "__main__":
    main()
