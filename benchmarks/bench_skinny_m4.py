"""The CUDA-core skinny GEMV (``ops.gemv``, ``SkinnyConfig(dot=False)``) at M = 1..4 against cuBLAS: the speculative
verify step's dense projections (batch 1, k = 1..3 drafts) at the full-size Qwen3.5-35B-A3B decode shapes.

Per (N, K) and M = 1, 2, 3, 4: cuBLAS (``F.linear``), the committed ``TABLE``'s choice, and a pruned sweep of
dot=False configs (BN 2/4/8/16, BK 256..4096 capped by K, warps 4/8, stages 1/2), each checked against the fp32
product ``F.linear(x.float(), w.float())`` (bf16 tolerance), for determinism (two calls, same bits) and for batch
invariance (its M < 4 rows equal its M = 4 rows bit for bit). Writes ``skinny_m4_<device>.{json,md}`` (best config
per (N, K, M), its speedup vs cuBLAS) and prints a TABLE fragment for ``gdnserve/ops/gemv/skinny_triton.py``.

    python -m benchmarks.bench_skinny_m4 [--out DIR] [--time-budget 110] [--shapes 2048x4096,...] [--ms 1,2,3,4]
        [--invariant-slack 0.02] [--jobs N] [--quick]

Timing (CUDA): max(``CALLS``, copies) calls back to back captured in one CUDA graph, replayed ``REPS`` (>= 50)
times with torch.cuda.Event around each replay; the median replay / calls. L2 is NOT flushed: the calls rotate over
weight copies of >= ``ROTATE`` (128 MB) in all per shape, one call per copy at least (the H200's L2 is 50 MB), so
each call streams W from HBM as a decode step does, while x (<= 32 KB) stays hot, as in a step. Compiling the ~260
kernel variants (36 configs x 4 M x N divisible by 16 or not) is most of the time: ``--jobs`` processes compile
them first into Triton's disk cache (the main process then loads them), and the sweep visits configs in priority
order (the table's first) over every shape, so a run cut by ``--time-budget`` still covers every shape with the
configs it reached (the report says so).

The TABLE fragment keeps every committed M = 1 entry of a shape already in the table (measured earlier, not
re-decided here) and the committed entries past M = 4; at M = 2..4 it takes the fastest of the sweep's best and the
committed measured config where that beats cuBLAS by 3 % (``WIN``), preferring the shape's M = 1 config where it is
within ``--invariant-slack`` of the best (rows then equal M = 1's bit for bit), and stops at the first M cuBLAS
wins (TABLE ranges cannot skip an M). ``--quick``: tiny shapes, two configs, wall-clock timing: a CPU smoke run of
the whole flow under TRITON_INTERPRET=1 (tests/test_bench_skinny_m4.py).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import jsonfmt
from benchmarks.bench_decode_b1 import graph_us
from gdnserve.ops.gemv import SkinnyConfig, skinny_linear, skinny_triton
from gdnserve.ops.numerics import rel_rms

SHAPES = ((2048, 4096, "GDN out_proj / attention o_proj / MTP fc"), (12352, 2048, "GDN in_proj"),
          (9216, 2048, "attention qkv_proj (target + MTP layer)"), (257, 2048, "router gate + shared expert's row"),
          (256, 2048, "router gate alone (FP8 models)"), (1024, 2048, "shared expert gate_up (not folded)"),
          (2048, 512, "shared expert down (not folded)"))
QUICK_SHAPES = ((24, 128, "tiny"), (17, 96, "tiny, odd N and K"))
QUICK_CONFIGS = (SkinnyConfig(8, 64, 4, 1, False), SkinnyConfig(16, 64, 4, 2, False))
MS = (1, 2, 3, 4)
WIN = 0.97            # the kernel must beat cuBLAS by 3 % to take an M (as benchmarks/bench_decode_b1.py)
CALLS, REPS = 20, 51  # calls per graph (at least; one per weight copy), graph replays (median)
ROTATE = 128 << 20    # weight bytes a graph's calls rotate over per shape: over twice the H200's L2
RTOL = 4e-3           # rel RMS vs the fp32 product (bf16 output rounding is ~2e-3)


def sweep_configs(K: int) -> list[SkinnyConfig]:
    """The pruned dot=False grid for a K: BN 2/4/8/16 x BK 256..4096 (<= K) x warps 4/8, kept where each thread
    holds 16..64 weight elements per K step (fewer starve the loads, more spill with 4 rows' products), stages 2
    only where the K loop has more than one step and a thread holds <= 32 (room for the second buffer)."""
    out = []
    for warps in (4, 8):
        for BN in (2, 4, 8, 16):
            for BK in (256, 512, 1024, 2048, 4096):
                per_thread = BN * BK // (32 * warps)
                if BK > K or not 16 <= per_thread <= 64:
                    continue
                out.append(SkinnyConfig(BN, BK, warps, 1, False))
                if BK < K and per_thread <= 32:
                    out.append(SkinnyConfig(BN, BK, warps, 2, False))
    return out


def table_configs(table: dict) -> list[SkinnyConfig]:
    return list(dict.fromkeys(c for entries in table.values() for _, c in entries if not c.dot))


def runs_on(cfg: SkinnyConfig, K: int, grid: list[SkinnyConfig], table: dict) -> bool:
    """Whether the sweep times ``cfg`` at this K: its grid's configs, and the table's dot=False ones (BK <= K)."""
    return cfg in grid or (cfg in table_configs(table) and cfg.BK <= K)


def ordered(cfgs: list[SkinnyConfig], first: list[SkinnyConfig]) -> list[SkinnyConfig]:
    """``first`` (the table's), then the rest nearest 32 weight elements a thread first (a budget cut keeps the
    likeliest)."""
    rest = sorted((c for c in cfgs if c not in first),
                  key=lambda c: (abs(math.log2(c.BN * c.BK / (32 * c.warps) / 32)), c.stages, c.warps, c.BN))
    return list(dict.fromkeys([*first, *rest]))


def committed(table: dict, N: int, K: int, M: int) -> SkinnyConfig | None:
    """The committed table's config at (N, K, M) (``skinny_config`` on that table)."""
    for bound, cfg in table.get((N, K), ()):
        if M <= bound:
            return cfg if cfg.dot or M <= skinny_triton.FMA_MAX_M else None
    return None


def wall_us(fn: Callable[[int], Any], calls: int = 1, reps: int = 1) -> float:
    """Quick mode: median wall µs of one call (the correctness checks ran it first)."""
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        ts.append((time.perf_counter() - t) * 1e6)
    return sorted(ts)[len(ts) // 2]


def _compile_worker(jobs: list[tuple[int, int, int, tuple]], device: str = "cuda") -> int:
    """Spawned process: launch every (N, K, M, config) once on small tensors with the real ones' specialisation
    (N's divisibility by 16, K): Triton writes each binary to its disk cache, where the main process finds it."""
    done = 0
    for N, K, M, cfg in jobs:
        try:
            x = torch.zeros(M, K, device=device, dtype=torch.bfloat16)
            skinny_linear(x, torch.zeros(N, K, device=device, dtype=torch.bfloat16), SkinnyConfig(*cfg))
            done += 1
        except Exception:                    # the main process compiles (and reports) it itself
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(variants: list[tuple[int, int, int, SkinnyConfig]], jobs: int, log, device: str = "cuda") -> None:
    """Compile ``variants`` in ``jobs`` spawned processes (Triton's disk cache is shared)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    reps = {}
    for N, K, M, cfg in variants:            # one small stand-in per binary: N's and K's divisibility, EVEN_K
        reps.setdefault((N % 16 == 0, K % 16 == 0, K % cfg.BK == 0, M, cfg), (16 if N % 16 == 0 else 17, K, M,
                                                                                tuple(cfg)))
    work = list(reps.values())
    chunks = [work[i::jobs] for i in range(jobs)]
    t = time.perf_counter()
    try:
        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
            done = sum(ex.map(_compile_worker, [c for c in chunks if c], [device] * jobs))
        log(f"precompiled {done}/{len(work)} variants in {jobs} processes, {time.perf_counter() - t:.1f} s")
    except Exception as e:                   # compile in-process instead
        log(f"precompile failed ({e!r}); compiling in the sweep")


def fragment(table: dict, shapes, best: dict, timed: dict, slack: float) -> tuple[dict, list[str]]:
    """The new TABLE entries per swept shape (see the module docstring) and notes on each choice.
    ``best[(N, K, M)]``: (config, µs) of the sweep's fastest passing config; ``timed[(N, K, M)]``: {"cublas": µs,
    "table": µs or None, "m1": µs of the shape's M = 1 config at this M or None}."""
    out, notes = {}, []
    for N, K, _ in shapes:
        old = table.get((N, K), ())
        m1 = committed(table, N, K, 1)
        entries: list[tuple[int, SkinnyConfig]] = []
        stopped = None
        for M in MS:
            t = timed.get((N, K, M))
            if t is None:
                stopped = M
                break
            if M == 1 and m1 is not None:                  # a measured M = 1 entry stays
                entries.append((1, m1))
                continue
            cands = []
            if (N, K, M) in best:
                cands.append((best[(N, K, M)][1], best[(N, K, M)][0], "sweep"))
            prov = M in skinny_triton.PROVISIONAL.get((N, K), ())
            cfg_t = committed(table, N, K, M)
            if cfg_t is not None and t.get("table") is not None and not prov:
                cands.append((t["table"], cfg_t, "committed"))
            cands = [c for c in cands if c[0] < WIN * t["cublas"]]
            if not cands:
                stopped = M
                notes.append(f"{N}x{K} M={M}: cuBLAS ({t['cublas']:.2f} us) wins")
                break
            us, cfg, why = min(cands, key=lambda c: c[0])
            m1_cfg = m1 if m1 is not None else (entries[0][1] if entries else None)
            if (m1_cfg is not None and not m1_cfg.dot and cfg != m1_cfg and t.get("m1") is not None
                    and t["m1"] <= (1 + slack) * us and t["m1"] < WIN * t["cublas"]):
                us, cfg, why = t["m1"], m1_cfg, f"M = 1's config (rows = M = 1's; best {us:.2f} us)"
            notes.append(f"{N}x{K} M={M}: {tuple(cfg)} {us:.2f} us ({why}) vs cuBLAS {t['cublas']:.2f} us")
            entries.append((M, cfg))
        if stopped is None:
            entries += [(b, c) for b, c in old if b > max(MS)]
        elif any(b >= stopped for b, _ in old):
            notes.append(f"{N}x{K}: the committed entries' M >= {stopped} dropped (a range cannot skip M = {stopped}; "
                         f"cuBLAS from M = {stopped} on)")
        merged: list[tuple[int, SkinnyConfig]] = []
        for b, c in entries:
            if merged and merged[-1][1] == c:
                merged[-1] = (b, c)
            else:
                merged.append((b, c))
        if merged:
            out[(N, K)] = tuple(merged)
    return out, notes


def fragment_text(frag: dict, shapes) -> str:
    what = {(n, k): w for n, k, w in shapes}
    lines = []
    for (N, K), entries in frag.items():
        body = ", ".join(f"({b}, SkinnyConfig({c.BN}, {c.BK}, {c.warps}, {c.stages}{'' if c.dot else ', False'}))"
                         for b, c in entries)
        lines.append(f"    ({N}, {K}): ({body},),   # {what.get((N, K), '')}")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    lines = [f"# Skinny GEMV at M = 1..4 vs cuBLAS ({res['device']})", "",
             f"commit {res['git']}; torch {res['torch']}; {res['timing']}; sweep: {res['configs swept']} dot=False "
             f"configs{' (CUT by the time budget: ' + res['truncated'] + ')' if res.get('truncated') else ''}; "
             f"{res['seconds']:.0f} s.", "",
             "| N x K | M | cuBLAS us | table us (cfg) | best dot=False cfg | us | TB/s | vs cuBLAS | M=1 cfg us | "
             "rows = M=4's | rel err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b = r.get("best") or {}
        tab = f"{r['table us']:.2f} ({r['table cfg']})" if r.get("table us") is not None else "-"
        lines.append(
            f"| {r['N']}x{r['K']} | {r['M']} | {r['cublas us']:.2f} | {tab} | {b.get('cfg', '-')} | "
            f"{b['us']:.2f} | {b['TB/s']:.2f} | {r['cublas us'] / b['us']:.2f}x | "
            f"{'-' if r.get('m1 cfg us') is None else format(r['m1 cfg us'], '.2f')} | "
            f"{b.get('rows invariant', '-')} | "
            f"{b['rel err']:.1e} |" if b else
            f"| {r['N']}x{r['K']} | {r['M']} | {r['cublas us']:.2f} | {tab} | no config passed | | | | | | |")
    lines += ["", "TABLE fragment (ops/gemv/skinny_triton.py; committed M = 1 entries kept):", "", "```python",
              res["fragment"] or "# (no entries: cuBLAS wins every swept shape at M = 1)", "```", "",
              *[f"- {n}" for n in res["notes"]], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_skinny_m4")
    ap.add_argument("--out", default="benchmarks/results", help="directory for skinny_m4_<device>.{json,md}")
    ap.add_argument("--time-budget", type=float, default=110.0, help="seconds; configs past it are not swept")
    ap.add_argument("--shapes", default=None, help="NxK,... (default: every model shape)")
    ap.add_argument("--ms", default=None, help="M values (default 1,2,3,4)")
    ap.add_argument("--invariant-slack", type=float, default=0.02,
                    help="prefer the M = 1 config at M = 2..4 when within this fraction of the best")
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes compiling the kernel variants first (0: compile in the sweep)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, two configs, wall time (CPU smoke run)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda" if cuda else ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = QUICK_SHAPES if a.quick else SHAPES
    if a.shapes:
        shapes = tuple(s for s in shapes if f"{s[0]}x{s[1]}" in a.shapes.split(","))
    ms = MS if a.ms is None else tuple(int(m) for m in a.ms.split(","))
    table = dict(skinny_triton.TABLE)
    timer = partial(graph_us, reps=REPS) if dev.type == "cuda" and not a.quick else wall_us
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(s: str) -> None:
        print(s, flush=True)

    from benchmarks.bench_ops import _git, device_slug
    g = _git()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "torch": torch.__version__, "git": (g or {}).get("commit", "?"),
                           "timing": (f"CUDA graph of max({CALLS}, copies) calls, median of {REPS} replays, L2 not "
                                      f"flushed, W rotated over copies >= {ROTATE >> 20} MB per shape"
                                      if timer is not wall_us
                                      else "wall clock of one call (smoke run)"),
                           "rows": []}
    stem = out / f"skinny_m4_{device_slug(dev)}"

    # inputs: x [4, K] (M rows are its first M), rotating weight copies, the fp32 references
    data = {}
    for N, K, _ in shapes:
        copies = 1 if not cuda else max(2, -(-ROTATE // (N * K * 2)))
        ws = [(torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(max(ms), K, device=dev).to(torch.bfloat16)
        data[(N, K)] = (ws, x, F.linear(x.float(), ws[0].float()))

    cfgs_by_k = {K: ([c for c in QUICK_CONFIGS if c.BK <= K] if a.quick else sweep_configs(K)) for _, K, _ in shapes}
    order = ordered(list(dict.fromkeys(c for v in cfgs_by_k.values() for c in v)),
                    [] if a.quick else table_configs(table))
    if cuda and a.jobs > 0:
        precompile([(N, K, M, c) for c in order for N, K, _ in shapes if runs_on(c, K, cfgs_by_k[K], table)
                    for M in ms], a.jobs, log)

    # cuBLAS and the committed table's choice
    timed: dict[tuple, dict] = {}
    for N, K, _ in shapes:
        ws, x, _ = data[(N, K)]
        for M in ms:
            xm = x[:M]
            calls = max(CALLS, len(ws))
            t = {"cublas": timer(lambda i: F.linear(xm, ws[i % len(ws)]), calls)}
            cfg = committed(table, N, K, M)
            t["table cfg"] = None if cfg is None else tuple(cfg)
            t["table"] = None if cfg is None else timer(lambda i: skinny_linear(xm, ws[i % len(ws)], cfg), calls)
            timed[(N, K, M)] = t

    # the sweep: configs outer (priority order), every shape and M inner
    results: dict[tuple, dict] = {}
    swept = 0
    for cfg in order:
        if time.perf_counter() - t0 > a.time_budget:
            res["truncated"] = f"{swept} of {len(order)} configs in {a.time_budget:.0f} s"
            log(f"time budget reached: {res['truncated']}")
            break
        swept += 1
        for N, K, _ in shapes:
            if not runs_on(cfg, K, cfgs_by_k[K], table):
                continue
            ws, x, ref = data[(N, K)]
            full = None
            for M in sorted(ms, reverse=True):           # the largest M first: the others' rows compare to it
                xm = x[:M]
                try:
                    y = skinny_linear(xm, ws[0], cfg)
                    det = bool(torch.equal(y, skinny_linear(xm, ws[0], cfg)))
                    err = float(rel_rms(y, ref[:M]))
                    inv = None if full is None else bool(torch.equal(y, full[:M]))
                    full = y if full is None else full
                    us = timer(lambda i: skinny_linear(xm, ws[i % len(ws)], cfg), max(CALLS, len(ws)))
                except Exception as e:                   # a config that does not compile / launch: skipped
                    log(f"{N}x{K} M={M} {tuple(cfg)}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                r = {"us": round(us, 3), "rel err": err, "deterministic": det, "rows invariant": inv}
                results.setdefault((N, K, M), {})[cfg] = r
        log(f"[{time.perf_counter() - t0:5.1f} s] {tuple(cfg)} swept")
    res["configs swept"] = swept

    best: dict[tuple, tuple[SkinnyConfig, float]] = {}
    for N, K, what in shapes:
        for M in ms:
            ok = {c: r for c, r in results.get((N, K, M), {}).items() if r["rel err"] < RTOL and r["deterministic"]}
            if ok:
                c, r = min(ok.items(), key=lambda kv: kv[1]["us"])
                best[(N, K, M)] = (c, r["us"])
    for N, K, what in shapes:
        m1 = committed(table, N, K, 1)                  # the shape's M = 1 config: the committed one, else the best
        m1 = m1 if m1 is not None else best.get((N, K, 1), (None,))[0]
        for M in ms:
            t = timed[(N, K, M)]
            r1 = results.get((N, K, M), {}).get(m1)
            t["m1"] = None if r1 is None else r1["us"]
            row: dict[str, Any] = {"N": N, "K": K, "what": what, "M": M, "cublas us": round(t["cublas"], 3),
                                   "table cfg": t["table cfg"],
                                   "table us": None if t["table"] is None else round(t["table"], 3),
                                   "m1 cfg us": None if t["m1"] is None else round(t["m1"], 3)}
            ok = {c: r for c, r in results.get((N, K, M), {}).items() if r["rel err"] < RTOL and r["deterministic"]}
            if (N, K, M) in best:
                c = best[(N, K, M)][0]
                r = ok[c]
                row["best"] = {"cfg": tuple(c), **r, "TB/s": round(N * K * 2 / r["us"] / 1e6, 3),
                               "speedup vs cublas": round(t["cublas"] / r["us"], 3)}
            row["failed"] = sorted(str(tuple(c)) for c, r in results.get((N, K, M), {}).items() if c not in ok)
            row["rows differ from M = 4's"] = sorted(str(tuple(c)) for c, r in results.get((N, K, M), {}).items()
                                                     if r["rows invariant"] is False)
            row["all"] = {str(tuple(c)): r for c, r in sorted(results.get((N, K, M), {}).items(),
                                                              key=lambda kv: kv[1]["us"])}
            res["rows"].append(row)
            b = row.get("best")
            log(f"{N}x{K} M={M}: cuBLAS {t['cublas']:.2f} us, table {row['table us']} {row['table cfg']}, "
                f"best {b and (b['cfg'], b['us'], b['speedup vs cublas'])}")
    frag, notes = fragment(table, shapes, best, timed, a.invariant_slack)
    varies = sorted({f"{r['N']}x{r['K']} {c}" for r in res["rows"] for c in r["rows differ from M = 4's"]})
    notes.append("every config's M < 4 rows equal its M = 4 rows bit for bit" if not varies else
                 f"NOT batch-invariant (rows differ from M = 4's): {', '.join(varies)}")
    res["fragment"] = fragment_text(frag, shapes)
    res["table"] = {f"{n}x{k}": [(m, tuple(c)) for m, c in v] for (n, k), v in frag.items()}
    res["notes"] = notes
    res["seconds"] = time.perf_counter() - t0
    stem.with_suffix(".json").write_text(jsonfmt.dumps(res))
    stem.with_suffix(".md").write_text(markdown(res))
    print("\n# TABLE fragment (ops/gemv/skinny_triton.py; committed M = 1 entries kept)\n" + res["fragment"])
    print("\n".join(notes))
    log(f"wrote {stem}.json / .md in {res['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
