"""Tile sweep of the routed-experts grouped GEMM (``ops/moe/grouped_triton.py``), each kernel timed alone.

For every (E, T) it times, per row block BM worth trying, each candidate tile set of the gate_up kernel, the
down kernel and the k-sum (``torch``: the ``view(T, k, H).sum(1)`` it replaced), checks every variant's MoE
output against a float64 reference on sampled tokens (the variant in place of the default for that kernel);
then end to end: ``before`` (BM and tiles of commit ff7685e), ``default`` (``moe_experts_triton``'s own
choice) and ``best`` (the best kernels assembled, per BM). GPU µs: CUDA-graph replay of back-to-back launches
rotating over several routings (so that a decode call does not find its experts' weights in L2), median
[P10–P90]. TFLOP/s = T k 6 H I / time (the GEMMs),
TB/s = weight bytes of the experts hit / time. The compiles run first in parallel worker processes (Triton's
disk cache), so the sweep is mostly timing (``--compile only``: just them; ``--compile no``: the cache has them).
Row blocks of 64 and more also time the TMA-descriptor kernels (``GU_TMA`` / ``DN_TMA``, ``grouped_tma_triton``).
``--best F`` writes the fastest end-to-end config per (E, T) for ``bench_moe --tiles F``.

    python -m benchmarks.sweep_moe --out benchmarks/results/moe_sweep_h200.log     (CUDA)
    python -m benchmarks.sweep_moe --experts 256 --tokens 4096,8192 --best best.json       (the prefill sizes)
    python -m benchmarks.sweep_moe --smoke                                        (CPU interpreter, tiny shapes)
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from typing import Any, Callable

import torch

from gdnserve.ops.moe import grouped_triton as gt
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe.combine_triton import combine
from gdnserve.ops.moe.grouped_triton import Config, Tiles
from gdnserve.ops.moe.naive import naive_moe_experts
from gdnserve.ops.numerics import rel_rms
from benchmarks import jsonfmt

T_ = Tiles
F, Y = False, True
GU_DECODE = [T_(32, 128, 4, 3), T_(32, 256, 4, 3), T_(32, 128, 4, 4), T_(32, 256, 4, 4), T_(32, 256, 8, 3),
             T_(64, 256, 8, 3), T_(32, 512, 8, 2), T_(16, 128, 2, 4), T_(16, 256, 4, 4),
             T_(16, 256, 4, 3, F, Y), T_(32, 256, 4, 3, F, Y), T_(16, 512, 4, 2, F, Y), T_(32, 128, 4, 4, F, Y),
             T_(64, 128, 4, 3, F, Y), T_(32, 256, 8, 3, F, Y)]
DN_DECODE = [T_(64, 128, 4, 3), T_(128, 128, 4, 3), T_(32, 128, 4, 3), T_(64, 256, 4, 3), T_(32, 256, 4, 3),
             T_(64, 128, 4, 4), T_(64, 512, 4, 2), T_(128, 256, 8, 3), T_(64, 128, 4, 3, Y), T_(128, 128, 4, 3, Y)]
GU_PREFILL = [T_(64, 64, 4, 3), T_(64, 64, 4, 3, Y), T_(128, 64, 8, 4), T_(128, 64, 8, 3, Y), T_(64, 64, 8, 3),
              T_(64, 64, 4, 3, F, Y), T_(64, 64, 4, 3, Y, Y), T_(64, 64, 4, 4, Y, Y), T_(128, 64, 4, 3, Y, Y),
              T_(128, 64, 8, 3, F, Y), T_(128, 64, 8, 3, Y, Y), T_(128, 64, 8, 4, Y, Y), T_(64, 64, 8, 3, Y, Y),
              T_(128, 32, 8, 4, Y, Y), T_(64, 128, 8, 3, Y, Y)]
DN_PREFILL = [T_(128, 64, 4, 3), T_(128, 64, 8, 3, Y), T_(256, 64, 8, 3, Y), T_(256, 64, 8, 4), T_(256, 64, 8, 4, Y),
              T_(128, 64, 8, 4, Y), T_(128, 128, 8, 3, Y), T_(256, 128, 8, 2, Y), T_(128, 64, 4, 3, Y),
              T_(64, 64, 4, 3, Y), T_(128, 128, 4, 3, Y), T_(128, 64, 4, 4, Y)]
# TMA weight tiles (grouped_tma_triton): (BN, BK, warps, stages, n_fast, one_dot, tma)
GU_TMA = [T_(128, 64, 8, 3, Y, F, Y), T_(128, 64, 8, 4, Y, F, Y), T_(128, 64, 4, 3, Y, F, Y), T_(64, 64, 4, 4, Y, F, Y),
          T_(64, 64, 4, 3, Y, F, Y), T_(128, 64, 8, 3, F, F, Y), T_(64, 128, 4, 3, Y, F, Y), T_(128, 128, 8, 2, Y, F, Y),
          T_(64, 64, 8, 4, Y, F, Y), T_(256, 64, 8, 2, Y, F, Y),
          T_(64, 64, 4, 3, Y, Y, Y), T_(64, 64, 4, 4, Y, Y, Y), T_(128, 64, 8, 3, Y, Y, Y), T_(128, 64, 8, 4, Y, Y, Y),
          T_(64, 64, 8, 3, Y, Y, Y), T_(64, 64, 8, 4, Y, Y, Y)]
DN_TMA = [T_(128, 64, 4, 3, Y, F, Y), T_(128, 64, 8, 3, Y, F, Y), T_(128, 64, 4, 4, Y, F, Y), T_(256, 64, 8, 3, Y, F, Y),
          T_(128, 128, 8, 3, Y, F, Y), T_(64, 128, 4, 3, Y, F, Y), T_(128, 64, 8, 4, F, F, Y), T_(256, 64, 8, 4, Y, F, Y),
          T_(128, 128, 4, 3, Y, F, Y), T_(64, 64, 4, 4, Y, F, Y)]
SUM_BLOCKS: list[int | str] = ["torch", 512, 1024, 2048]     # "torch": pair_out.view(T, k, H).sum(1), as before


def old_config(T: int, k: int, E: int, H: int, I: int) -> tuple[int, Config]:
    """The row block and tiles before this sweep (commit ff7685e), for the end-to-end comparison."""
    per = T * k / E
    BM = 16 if per <= 16 else (32 if per <= 32 else 64)
    from gdnserve.ops.moe.align import padded_rows
    nb = min(padded_rows(T * k, E, BM) // BM, T * k)
    bn2 = 128 if nb * -(-H // 128) >= 256 else 64
    if nb * -(-I // 64) < 256:
        return BM, Config(Tiles(32, 128, 4, 3), Tiles(bn2, 128, 4, 3), "torch")
    return BM, Config(Tiles(64, 64, 4, 3), Tiles(bn2, 64, 4, 3), "torch")


def k_sum(pair: torch.Tensor, T: int, k: int, t: int | str) -> torch.Tensor:
    return pair.view(T, k, -1).sum(1) if t == "torch" else combine(pair, T, k, t)


def candidates(T: int, BM: int) -> dict[str, list[Tiles]]:
    """Tile sets per kernel worth timing at this shape."""
    if BM <= 16:
        return {"gate_up": GU_DECODE, "down": DN_DECODE}
    if BM == 32:
        return {"gate_up": GU_DECODE[:6] + GU_PREFILL[:8], "down": DN_DECODE[:6] + DN_PREFILL[:6]}
    return {"gate_up": GU_PREFILL + GU_TMA, "down": DN_PREFILL + DN_TMA}


def row_blocks(T: int, E: int, k: int) -> list[int]:
    """The default BM and its neighbours worth trying."""
    bm = gt.block_rows(T * k, E)
    per = T * k / E
    out = {bm}
    if per > 24:
        out |= {64} | ({128} if per >= 96 else set()) | ({32} if per <= 64 else set())
    return sorted(out)


class Shapes:
    def __init__(self, smoke: bool) -> None:
        self.H, self.I, self.K = (64, 48, 4) if smoke else (2048, 512, 8)
        self.experts = [8] if smoke else [256, 64]
        self.tokens = [1, 3, 20] if smoke else [1, 4, 16, 64, 256, 1024, 4096, 8192]


# ----------------------------------------------------------------------------------------------------- inputs
def make_weights(E: int, H: int, I: int, dev: torch.device, gen: torch.Generator):
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gu = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / H ** 0.5).to(dt)
    dn = (torch.randn(E, H, I, device=dev, generator=gen) / I ** 0.5).to(dt)
    return gu, dn


def make_routing(T: int, E: int, k: int, H: int, dt: torch.dtype, dev: torch.device, gen: torch.Generator):
    x = torch.randn(T, H, device=dev, generator=gen).to(dt)
    p, idx = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=gen), -1), k, dim=-1)
    return x, (p / p.sum(-1, keepdim=True)).to(dt).contiguous(), idx


def reference(x, w, idx, gu, dn, n: int = 16):
    """float64 output of sampled tokens (the first, the last, spread between) and their indices."""
    T = x.shape[0]
    s = torch.linspace(0, T - 1, min(T, n), device=x.device).round().long().unique()
    used = idx[s].unique()
    local = torch.searchsorted(used, idx[s])
    return s, naive_moe_experts(x[s], w[s], local, gu[used], dn[used])


# ------------------------------------------------------------------------------------------------------ runs
def run_variant(kind: str, t: Tiles | int | str, s: dict, gu, dn, k: int, base: Config) -> torch.Tensor:
    """The MoE output with ``t`` in place of the default tiles of kernel ``kind``."""
    x, w, al = s["x"], s["w"], s["al"]
    T, N = x.shape[0], x.shape[0] * k
    pw = w.reshape(-1)
    inter = gt.gate_up(x, al, gu, k, t if kind == "gate_up" else base.gate_up)
    pair = gt.down(inter, al, dn, pw, N, t if kind == "down" else base.down)
    return k_sum(pair, T, k, t if kind == "sum" else base.sum_block)


def moe_call(s: dict, gu, dn, k: int, cfg: Config | None) -> torch.Tensor:
    """The whole op: the library's own choice (cfg None, ``moe_experts_triton``) or the three kernels of ``cfg``."""
    if cfg is None:
        return gt.moe_experts_triton(s["x"], s["w"], s["al"], gu, dn, k)
    T, N = s["x"].shape[0], s["x"].shape[0] * k
    inter = gt.gate_up(s["x"], s["al"], gu, k, cfg.gate_up)
    return k_sum(gt.down(inter, s["al"], dn, s["w"].reshape(-1), N, cfg.down), T, k, cfg.sum_block)


def kernel_call(kind: str, t: Tiles | int, s: dict, gu, dn, k: int) -> Callable[[], Any]:
    """The one kernel of ``kind`` alone, on the set's precomputed inputs."""
    x, w, al = s["x"], s["w"], s["al"]
    T, N = x.shape[0], x.shape[0] * k
    pw = w.reshape(-1)
    if kind == "gate_up":
        return lambda: gt.gate_up(x, al, gu, k, t)
    if kind == "down":
        return lambda: gt.down(s["inter"], al, dn, pw, N, t)
    return lambda: k_sum(s["pair"], T, k, t)


def gpu_us(calls: list[Callable[[], Any]], target_us: float = 2000.0, replays: int = 9) -> list[float]:
    """Per-call µs of graph replays of n back-to-back calls rotating over ``calls`` (wall time on CPU)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        calls[0]()
        return [(time.perf_counter() - t0) * 1e6]
    for c in calls:
        c()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for c in calls:
        c()
    b.record()
    b.synchronize()
    est = a.elapsed_time(b) * 1e3 / len(calls)
    n = len(calls) * max(1, min(256 // len(calls), math.ceil(target_us / max(est, 1.0) / len(calls))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return out


def pct(v: list[float]) -> dict[str, float]:
    v = sorted(v)
    pick = lambda q: v[min(len(v) - 1, round(q * (len(v) - 1)))]  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9)}


# --------------------------------------------------------------------------------------------- precompile
def jobs(sh: Shapes) -> list[tuple]:
    """(kind, BM, tiles, T) covering every compile the sweep will need (N = T k decides one specialisation)."""
    out = set()
    for E in sh.experts:
        for T in sh.tokens:
            for BM in row_blocks(T, E, sh.K):
                Tspec = 1 if (T * sh.K) % 16 else 16
                for kind, ts in dict(candidates(T, BM), sum=SUM_BLOCKS).items():
                    for t in ts:
                        if t == "torch":
                            continue
                        out.add((kind, BM, t, Tspec))
    return sorted(out, key=str)


def _compile_worker(part: list[tuple]) -> int:
    """Run each job's kernel once on small inputs with the same specialisation (Triton's disk cache keeps it)."""
    sh = Shapes(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gu, dn = make_weights(16, sh.H, sh.I, dev, gen)
    done = 0
    for kind, BM, t, T in part:
        x, w, idx = make_routing(T, 16, sh.K, sh.H, torch.bfloat16, dev, gen)
        try:
            kernel_call(kind, t, prepare(x, w, idx, 16, BM, gu, dn, sh.K), gu, dn, sh.K)()
            done += 1
        except Exception as e:  # noqa: BLE001 - reported again (with the reason) when the sweep runs it
            print(f"compile {kind} BM={BM} {t}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(sh: Shapes, procs: int) -> None:
    js = jobs(sh)
    parts = [js[i::procs] for i in range(procs)]
    t0 = time.time()
    try:
        with mp.get_context("spawn").Pool(procs) as pool:
            n = sum(pool.map_async(_compile_worker, parts).get(timeout=240))
    except Exception as e:  # noqa: BLE001 - the sweep compiles what is missing itself
        print(f"precompile failed ({type(e).__name__}: {e}); compiling in the sweep", flush=True)
        n = -1
    print(f"precompiled {n}/{len(js)} kernel variants in {time.time() - t0:.0f} s with {procs} processes", flush=True)


def prepare(x, w, idx, E: int, BM: int, gu, dn, k: int) -> dict:
    """One input set: the alignment and the default intermediate / pair outputs each kernel reads."""
    al = align_pairs(idx, E, BM)
    s = {"x": x, "w": w, "idx": idx, "al": al}
    N = x.shape[0] * k
    base = gt.config(N, BM)
    s["inter"] = gt.gate_up(x, al, gu, k, base.gate_up)
    s["pair"] = gt.down(s["inter"], al, dn, w.reshape(-1), N, base.down)
    return s


# ---------------------------------------------------------------------------------------------------- sweep
def best_configs(rows: list[dict], K: int) -> dict[str, list]:
    """The fastest end-to-end config per (E, T) among ``default`` and the assembled ``best`` (bench_moe --tiles):
    {"E,T": [BM, gate_up tiles, down tiles, sum_block]}."""
    out: dict[str, tuple[float, list]] = {}
    for r in rows:
        if r["kernel"] not in ("e2e default", "e2e best") or r["rel_rms"] >= 1.5e-2:
            continue
        cfg = r["config"] or gt.config(r["T"] * K, r["BM"])
        key = f"{r['E']},{r['T']}"
        if key not in out or r["gpu_us"]["p50"] < out[key][0]:
            out[key] = (r["gpu_us"]["p50"], [r["BM"], list(cfg.gate_up), list(cfg.down), cfg.sum_block])
    return {k: v[1] for k, v in out.items()}


def sweep(sh: Shapes, log: Callable[[str], None], ceil: dict) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict] = []
    H, I, K = sh.H, sh.I, sh.K
    for E in sh.experts:
        gen = torch.Generator(device=dev).manual_seed(E)
        gu, dn = make_weights(E, H, I, dev, gen)
        for T in sh.tokens:
            n_sets = 8 if T <= 16 else (4 if T <= 256 else 1)
            routings = [make_routing(T, E, K, H, gu.dtype, dev, gen) for _ in range(n_sets)]
            hit = sum(int(torch.unique(r[2]).numel()) for r in routings) / n_sets
            wbytes, flops = hit * 3 * H * I * gu.element_size(), T * K * 6 * H * I
            x0, w0, idx0 = routings[0]
            s_idx, ref = reference(x0, w0, idx0, gu, dn)
            assembled: list[tuple[int, Config]] = []
            for BM in row_blocks(T, E, K):
                sets = [prepare(x, w, idx, E, BM, gu, dn, K) for x, w, idx in routings]
                N = T * K
                base = gt.config(N, BM)
                cands = dict(candidates(T, BM), sum=SUM_BLOCKS)
                default = {"gate_up": base.gate_up, "down": base.down, "sum": base.sum_block}
                best: dict[str, tuple[float, Any]] = {}
                for kind, ts in cands.items():
                    for t in ts:
                        rec = {"E": E, "T": T, "BM": BM, "kernel": kind,
                               "tiles": list(t) if isinstance(t, Tiles) else t, "default": default.get(kind) == t}
                        try:
                            out = run_variant(kind, t, sets[0], gu, dn, K, base)
                            rec["rel_rms"] = err = rel_rms(out[s_idx], ref)
                            us = gpu_us([kernel_call(kind, t, s, gu, dn, K) for s in sets])
                        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
                            rec["error"] = f"{type(e).__name__}: {e}"[:200]
                            rows.append(rec)
                            log(json.dumps(rec))
                            continue
                        rec["gpu_us"] = pct(us)
                        rec["ok"] = err < 1.5e-2
                        rows.append(rec)
                        p50 = rec["gpu_us"]["p50"]
                        if rec["ok"] and t != "torch" and (kind not in best or p50 < best[kind][0]):
                            best[kind] = (p50, t)
                        log(f"E={E:3d} T={T:5d} BM={BM:3d} {kind:7s} {str(rec['tiles']):28s} {p50:8.1f} us "
                            f"[{rec['gpu_us']['p10']:.1f}-{rec['gpu_us']['p90']:.1f}] err {err:.1e}"
                            f"{'' if rec['ok'] else ' FAIL'}{' (default)' if rec['default'] else ''}")
                if "gate_up" in best and "down" in best and "sum" in best:
                    assembled.append((BM, Config(best["gate_up"][1], best["down"][1], best["sum"][1])))
            # end to end: the shape-chosen default (BM from block_rows) against the best assembled config
            runs = [("before", *old_config(T, K, E, H, I)), ("default", gt.block_rows(T * K, E), None)]
            for label, BM, cfg in runs + [("best", bm, c) for bm, c in assembled]:
                sets = [prepare(x, w, idx, E, BM, gu, dn, K) for x, w, idx in routings]
                err = rel_rms(moe_call(sets[0], gu, dn, K, cfg)[s_idx], ref)
                us = pct(gpu_us([(lambda s=s: moe_call(s, gu, dn, K, cfg)) for s in sets]))
                rec = {"E": E, "T": T, "BM": BM, "kernel": "e2e " + label, "config": cfg, "gpu_us": us,
                       "rel_rms": err, "TFLOPs": flops / us["p50"] / 1e6, "TBps": wbytes / us["p50"] / 1e6}
                rows.append(rec)
                log(f"E={E:3d} T={T:5d} BM={BM:3d} e2e {label:12s} {us['p50']:8.1f} us [{us['p10']:.1f}-"
                    f"{us['p90']:.1f}] {rec['TFLOPs']:6.1f} TFLOP/s ({rec['TFLOPs'] / ceil['bf16']:.0%} of "
                    f"{ceil['bf16']:.0f}) {rec['TBps']:.2f} TB/s ({rec['TBps'] / ceil['copy']:.0%} of "
                    f"{ceil['copy']:.2f}) err {err:.1e} {cfg if cfg else ''}")
        del gu, dn
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="log file (also printed)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: the script runs")
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--experts", default=None)
    ap.add_argument("--best", default=None, help="write the fastest config per (E, T) here (bench_moe --tiles)")
    ap.add_argument("--compile", choices=["yes", "no", "only"], default="yes",
                    help="the parallel precompile first (yes), skip it (no: the disk cache has it), or only it")
    ap.add_argument("--procs", type=int, default=min(16, os.cpu_count() or 1))
    a = ap.parse_args()
    sh = Shapes(a.smoke)
    if a.tokens:
        sh.tokens = [int(t) for t in a.tokens.split(",")]
    if a.experts:
        sh.experts = [int(e) for e in a.experts.split(",")]
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    ceil = {"bf16": float("nan"), "copy": float("nan")}
    if torch.cuda.is_available():
        from benchmarks.timing import measure_ceilings
        c = measure_ceilings(torch.device("cuda"), quick=True)
        ceil = {"bf16": c["bf16_matmul_TFLOPs"], "copy": c["copy_TBps"]}
        log(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; ceilings: copy {ceil['copy']:.2f} TB/s, "
            f"bf16 matmul {ceil['bf16']:.0f} TFLOP/s; H={sh.H} I={sh.I} top-{sh.K}")
        t0 = time.time()
        if a.compile != "no":
            precompile(sh, a.procs)
            log(f"# precompile {time.time() - t0:.0f} s")
        if a.compile == "only":
            return
    t0 = time.time()
    rows = sweep(sh, log, ceil)
    log(f"# sweep {time.time() - t0:.0f} s")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if a.best:
        with open(a.best, "w") as f:
            f.write(jsonfmt.dumps(best_configs(rows, sh.K)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, default=lambda o: list(o) if isinstance(o, tuple) else str(o))


if __name__ == "__main__":
    main()
