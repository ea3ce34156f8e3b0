"""Offline tuning of the chunked prefill on the GPU: the whole chunk call timed for several launch configs
(``gdnserve/ops/gdn/chunk_configs.py`` fields), each variant's error against our fp32 PyTorch path, fla
beside; then the final-state error against length and head size (bf16 activations, fp32 pool).

    python -m benchmarks.tune_chunk [--quick] [--out DIR]     # on the device; writes tune_chunk_<gpu>.json
    python -m benchmarks.tune_chunk --bench [--out DIR]       # + bench_ops' prefill rows with the chosen row
    python -m benchmarks.tune_chunk --accuracy [--out DIR]    # only the state error vs length (GPU, fla beside)
    python -m benchmarks.tune_chunk --stages [--out DIR]      # per-stage times of STAGE_VARIANTS, old vs new
    TRITON_INTERPRET=1 python -m benchmarks.tune_chunk --cpu-accuracy   # state error vs length, small heads, CPU

The row of ``chunk_configs.TABLE`` for a GPU is chosen from the "variants" table this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from gdnserve.ops.gdn import chunk_triton as ct
from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
from gdnserve.ops.gdn.chunk_configs import chunk_config, override
from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.varlen import VarlenMeta
from benchmarks import jsonfmt

H, HV, K, V = 16, 32, 128, 128
dev = "cuda"
BIG = dict(state_bv=128, state_warps=8, seg_bv=128, seg_warps=8)
CP = dict(cp_min_chunks=32)
VARIANTS = {   # name -> ChunkConfig overrides (the rounds in docs/kernels.md ruled out the state pass forming O itself)
    "sequential, BV 32": {},
    "CP (state BV 32; seg BV 128, 8 warps)": dict(CP, seg_bv=128, seg_warps=8),
    "CP, BV 128 8 warps": dict(CP, **BIG),
    "CP, BV 128 16 warps": {**CP, **BIG, "state_warps": 16},
    "CP seg 32, BV 128 8 warps": {**CP, **BIG, "cp_seg_chunks": 32},
    "CP, BV 64 4 warps": dict(CP, state_bv=64, seg_bv=128, seg_warps=8),
}
SHAPES = {"1x32768": [32768], "64x256": [256] * 64, "8x4096": [4096] * 8, "1x8192": [8192],
          "1P512+16C64 (independent)": [512] + [64] * 16}


def events(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    n = len(ts)
    return {"p50": round(ts[n // 2], 1), "p10": round(ts[n // 10], 1), "p90": round(ts[(9 * n) // 10], 1)}


def inputs(lens, k_dim=None, regime_alog=(1, 16)):
    k_dim = k_dim or K
    T = sum(lens)
    D = 2 * H * k_dim + HV * k_dim
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    q = x[:, :H * k_dim].view(T, H, k_dim)
    k = x[:, H * k_dim:2 * H * k_dim].view(T, H, k_dim)
    v = x[:, 2 * H * k_dim:].view(T, HV, k_dim)
    a = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    b = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(*regime_alog))
    dt_bias = torch.rand(HV, device=dev)
    return q, k, v, a, b, A_log, dt_bias


def _case(lens):
    """One tuning case: (T, the inputs, a random state pool of 2N + 2 slots, its VarlenMeta, source slots 0..N-1,
    destination slots N..2N-1, a workspace and the output buffer)."""
    T, N = sum(lens), len(lens)
    tensors = inputs(lens)
    pool = torch.randn(2 * N + 2, HV, V, K, device=dev) * 0.1
    meta = VarlenMeta.build(lens, dev)
    src = torch.arange(N, dtype=torch.int32, device=dev)
    dst = torch.arange(N, 2 * N, dtype=torch.int32, device=dev)
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, torch.bfloat16, dev)
    return T, tensors, pool, meta, src, dst, ws, torch.empty(T, HV, V, device=dev, dtype=torch.bfloat16)


def fla_fn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception as e:  # noqa: BLE001
        print("no fla:", e)
        return None

    def make(q, k, v, a, b, A_log, dt_bias, h0, lens):
        g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
        beta = b.float().sigmoid()
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.long)
        ci = prepare_chunk_indices(cu, 64)
        cpu = cu.cpu()
        return lambda: fla_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
                                 cu_seqlens=cu, cu_seqlens_cpu=cpu, chunk_indices=ci)
    return make


def exactness(var: dict) -> dict:
    """On the GPU, at the real head dims: varlen == per-sequence and parents == serial, bit for bit, with a
    context-parallel sequence among them (mild gates, so segment starts matter)."""
    lens, par = [4200, 300, 64], [-1, 0, 0]
    q, k, v, a, b, A_log, dt_bias = inputs(lens, regime_alog=(0.04, 0.06))
    pool = torch.randn(8, HV, V, K, device=dev) * 0.1
    cu = [0, 4200, 4500, 4564]
    I = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    call = lambda sl, ln, p, s_, d_, pa=None: chunk_gated_delta_rule(  # noqa: E731
        q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, p, VarlenMeta.build(ln, dev), I(s_), I(d_),
        None if pa is None else I(pa))
    with override(**var):
        p1, p2 = pool.clone(), pool.clone()
        o1 = call(slice(None), lens, p1, [0, 1, 2], [3, 4, 5])
        o2 = torch.cat([call(slice(cu[i], cu[i + 1]), [lens[i]], p2, [i], [3 + i]) for i in range(3)])
        varlen = bool(torch.equal(o1, o2) and torch.equal(p1, p2))
        p3, p4 = pool.clone(), pool.clone()
        o3 = call(slice(None), lens, p3, [0, -1, -1], [3, 4, 5], par)
        o4 = torch.cat([call(slice(0, 4200), [4200], p4, [0], [3]), call(slice(4200, None), lens[1:], p4, [3, 3], [4, 5])])
        parents = bool(torch.equal(o3, o4) and torch.equal(p3, p4))
        ref = pool.clone()
        ro = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ref, VarlenMeta.build(lens, dev), I([0, -1, -1]),
                                    I([3, 4, 5]), I(par), backend="torch")
    return {"varlen_eq_per_seq": varlen, "parents_eq_serial": parents, "parents_err_o": rel_rms(o3, ro),
            "parents_err_state": rel_rms(p3, ref)}


def conv_times() -> list[dict]:
    from gdnserve.ops.conv import causal_conv1d_prefill
    rows = []
    for label, lens in (("1x32768", [32768]), ("64x256", [256] * 64)):
        T, N, D = sum(lens), len(lens), 2 * H * K + HV * V
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(D, 4, device=dev, dtype=torch.bfloat16)
        cp = torch.randn(2 * N, 3, D, device=dev, dtype=torch.bfloat16)
        meta = VarlenMeta.build(lens, dev)
        s_ = torch.arange(N, dtype=torch.int32, device=dev)
        y = torch.empty_like(x)
        f = lambda: causal_conv1d_prefill(x, w, cp, meta, s_, s_ + N, out=y)  # noqa: E731
        t = events(f)
        rows.append({"conv": label, "us": t, "TBps": round(2 * x.numel() * 2 / (t["p50"] * 1e-6) / 1e12, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def tune(quick: bool) -> list[dict]:
    rows = []
    make_fla = fla_fn()
    shapes = {k: SHAPES[k] for k in (["1x32768", "64x256"] if quick else SHAPES)}
    for label, lens in shapes.items():
        T, (q, k, v, a, b, A_log, dt_bias), pool, meta, src, dst, ws, o = _case(lens)
        N = len(lens)
        ref_pool = pool.clone()
        ref_o = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ref_pool, meta, src, dst, backend="torch")
        names = list(VARIANTS)
        pick = os.environ.get("TUNE_VARIANTS")     # e.g. "2,0": a subset, in that order
        for name in ([names[int(i)] for i in pick.split(",")] if pick else names):
            var = VARIANTS[name]
            row = {"shape": label, "T": T, "variant": name, "overrides": var}
            try:
                if label == "1x32768":
                    row.update(exactness(var))
                with override(**var):
                    p = pool.clone()
                    chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, src, dst, out=o, workspace=ws)
                    row["err_o"], row["err_state"] = rel_rms(o, ref_o), rel_rms(p[N:2 * N], ref_pool[N:2 * N])
                    row["us"] = events(lambda: chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, src,
                                                                      dst, out=o, workspace=ws))
                    if name == next(iter(VARIANTS)) or name == "CP, BV 128 8 warps":
                        row["prep_us"] = events(lambda: ct.launch_prep(q, k, v, a, b, A_log, dt_bias, meta, ws, o))
                        row["state_us"] = events(lambda: ct.launch_state(q, k, v, p, meta, src, dst, None, ws,
                                                                         K ** -0.5, o))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        if make_fla is not None and not quick:
            f = make_fla(q, k, v, a, b, A_log, dt_bias, pool[:N].clone(), lens)
            fo, fs = f()
            row = {"shape": label, "T": T, "variant": "fla", "err_o": rel_rms(fo[0], ref_o),
                   "err_state": rel_rms(fs, ref_pool[N:2 * N]), "us": events(f)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws, q, k, v, pool, ref_pool
        torch.cuda.empty_cache()
    return rows


STAGE_VARIANTS = {   # name -> ChunkConfig overrides, timed per stage by --stages
    "new": {},
    "new prep split always": dict(prep_split_below=1 << 30),
    "new state BV 64 8 warps": dict(state_bv=64, state_warps=8),
    "new state BV 32 8 warps": dict(state_warps=8),
    "new inv_bf16": dict(inv_bf16=True),
    "new no short tile": dict(short_prep=0),
}
RFC_ONLY = ("new no short tile",)                      # variants timed only at the RFC shape
RFC_VARIANTS = ("new", "new no short tile")


def best_variant(rows: list[dict], shapes=("1x4096", "8x1024")) -> str:
    """The new variant of least summed whole-call time over ``shapes`` among those within §6.4's 5e-3."""
    tot: dict[str, float] = {}
    for r in rows:
        if r["shape"] in shapes and "us" in r:
            ok = r["err_o"] < 5e-3 and r["err_state"] < 5e-3
            tot[r["variant"]] = tot.get(r["variant"], 0.) + (r["us"]["p50"] if ok else float("inf"))
    return min(tot, key=tot.get) if tot else "new"


def rfc_group_lens(groups: int = 16, consumers: int = 10, seed: int = 0) -> tuple[list[int], list[int]]:
    """The RFC serve workload's grouped step: per group one 600-token producer and consumers of 16-32 tokens
    continuing from it (parents)."""
    g = torch.Generator().manual_seed(seed)
    lens, par = [], []
    for _ in range(groups):
        p = len(lens)
        lens.append(600)
        par.append(-1)
        for _ in range(consumers):
            lens.append(int(torch.randint(16, 33, (1,), generator=g)))
            par.append(p)
    return lens, par


def stages(names: list[str] | None = None, shapes: dict | None = None) -> list[dict]:
    """Per-stage GPU time (events) of each STAGE_VARIANTS row at the profile's shapes (1x4096, 8x1024) and the RFC
    grouped step, with the output / final-state rel-RMS against our fp32 PyTorch path."""
    rows = []
    if shapes is None:
        rfc, rfc_par = rfc_group_lens()
        shapes = {"1x4096": ([4096], None), "8x1024": ([1024] * 8, None), "rfc 16x(P600+10C16-32)": (rfc, rfc_par)}
    for label, (lens, par) in shapes.items():
        T, (q, k, v, a, b, A_log, dt_bias), pool, meta, src, dst, ws, o = _case(lens)
        N = len(lens)
        pa = None if par is None else torch.tensor(par, dtype=torch.int32, device=dev)
        ref_pool = pool.clone()
        ref_o = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ref_pool, meta, src, dst, pa, backend="torch")
        scale = K ** -0.5
        for name in names or list(STAGE_VARIANTS):
            rfc = label.startswith("rfc")
            if (rfc and name not in RFC_VARIANTS) or (not rfc and name in RFC_ONLY):
                continue
            var = STAGE_VARIANTS[name]
            row = {"shape": label, "T": T, "variant": name, "overrides": var}
            try:
                with override(**var):
                    p = pool.clone()
                    def call():
                        return chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, src, dst, pa, out=o,
                                                      workspace=ws)
                    call()
                    row["err_o"], row["err_state"] = rel_rms(o, ref_o), rel_rms(p[N:2 * N], ref_pool[N:2 * N])
                    row["us"] = events(call)
                    row["prep_us"] = events(lambda: ct.launch_prep(q, k, v, a, b, A_log, dt_bias, meta, ws, o, scale))
                    row["state_us"] = events(lambda: ct.launch_state(q, k, v, p, meta, src, dst, pa, ws, scale, o))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws, q, k, v, pool, ref_pool
        torch.cuda.empty_cache()
    return rows


def accuracy(quick: bool) -> list[dict]:
    """Final-state rel-RMS vs length and head size against our fp32 PyTorch path (itself ~3e-7 from a float64
    recurrence, docs/kernels.md), one sequence from a random initial state, Qwen-like and slow decay."""
    rows = []
    make_fla = fla_fn()
    for kd in ((128,) if quick else (128, 64)):
        for regime, alog in ((("slow", (0.004, 0.006)),) if quick else (("qwen", (1, 16)), ("slow", (0.004, 0.006)))):
            for L in [1, 1024, 8192, 32768]:
                q, k, v, a, b, A_log, dt_bias = inputs([L], kd, alog)
                pool = torch.randn(2, HV, kd, kd, device=dev) * 0.1
                meta = VarlenMeta.build([L], dev)
                s0, s1 = (torch.tensor([i], dtype=torch.int32, device=dev) for i in (0, 1))
                ref = pool.clone()
                chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ref, meta, s0, s1, backend="torch")
                row = {"K=V": kd, "gates": regime, "L": L}
                for name, var in (("ours", {}), ("ours CP BV128", dict(CP, **BIG))):
                    try:
                        with override(**var):
                            p = pool.clone()
                            chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, s0, s1)
                            row[name] = rel_rms(p[1], ref[1])
                    except Exception as e:   # a variant that does not compile here (shared memory) is reported
                        row[name] = f"{type(e).__name__}: {str(e)[:120]}"
                if make_fla is not None:
                    row["fla"] = rel_rms(make_fla(q, k, v, a, b, A_log, dt_bias, pool[:1].clone(), [L])()[1], ref[1:])
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def cpu_accuracy(heads=(32, 64), lengths=(1, 64, 1024, 4096)) -> list[dict]:
    """The state-error sweep at small heads on the CPU (TRITON_INTERPRET=1 before starting Python): slow gates,
    HV = 2, random initial state, against the float64 recurrence; [output, final state] rel-RMS."""
    from gdnserve.ops.gdn.naive import naive_prefill_pool
    torch.manual_seed(0)
    rows = []
    ix = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    for kd in heads:
        for L in lengths:
            x = lambda *sh: torch.randn(*sh).to(torch.bfloat16)  # noqa: E731
            q, k, v, a, b = x(L, 1, kd), x(L, 1, kd), x(L, 2, kd), x(L, 2), x(L, 2)
            A_log = (torch.full((2,), 0.005).log() + 0.1 * torch.randn(2)).float()
            dt_bias = torch.rand(2)
            pool = torch.randn(2, 2, kd, kd) * 0.5
            ro, rp = naive_prefill_pool(q, k, v, a, b, A_log, dt_bias, pool, [L], [0], [1])
            row = {"K=V": kd, "L": L}
            for name, cfg, be in (("default", {}, "triton"), ("cp", dict(cp_min_chunks=4, cp_seg_chunks=4), "triton"),
                                  ("torch fp32", {}, "torch")):
                p = pool.clone()
                with override(**cfg):
                    o = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, VarlenMeta.build([L], "cpu"),
                                               ix([0]), ix([1]), backend=be)
                row[name] = [float("%.3g" % rel_rms(o, ro)), float("%.3g" % rel_rms(p[1], rp[1]))]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def bench_prefill(out: Path, shapes=((1, 8192), (1, 32768), (8, 4096), (64, 256)), cfg: dict | None = None) -> None:
    """bench_ops' prefill rows only (conv + chunk, ours vs fla, same run) with the ChunkConfig
    overrides ``cfg`` on "ours", written as ops_prefill_<gpu>.*"""
    from benchmarks import bench_ops as bo
    bo.make_plan = lambda cuda, quick: bo.Plan(bo.QWEN35_GDN, tuple(shapes), (), (), iters=30, warmup=3, host_iters=50)
    sub = out / "ops_prefill"
    with override(**(cfg or {})):
        res = bo.run(torch.device("cuda"), quick=False, out_dir=sub, use_fla=True)
    for kind, p in res["paths"].items():
        Path(p).rename(out / f"ops_prefill_{res['device_slug']}.{kind}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune_chunk", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bench", action="store_true", help="also run bench_ops' prefill rows")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--accuracy", action="store_true", help="only the state-error sweep against length (GPU)")
    ap.add_argument("--cpu-accuracy", action="store_true", help="the small-head state-error sweep on the CPU")
    ap.add_argument("--stages", action="store_true", help="only the per-stage times of STAGE_VARIANTS (GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args(argv)
    if args.cpu_accuracy:
        with torch.inference_mode():
            cpu_accuracy()
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name()
    res = {"device": name, "config": repr(chunk_config(torch.device("cuda")))}
    slug = name.lower().replace("nvidia ", "").replace(" ", "_")
    with torch.inference_mode():
        if args.stages:
            pick = os.environ.get("TUNE_VARIANTS")
            res["stages"] = stages([list(STAGE_VARIANTS)[int(i)] for i in pick.split(",")] if pick else None)
            res["best"] = best_variant(res["stages"])
            print(f"best: {res['best']} {STAGE_VARIANTS[res['best']]}", flush=True)
            (out / f"tune_chunk_stages_{slug}.json").write_text(jsonfmt.dumps(res))
            if args.bench:   # bench_ops' rows at the profile's shapes with the best variant as "ours"
                bench_prefill(out, ((1, 4096), (8, 1024)), STAGE_VARIANTS[res["best"]])
            return 0
        elif args.accuracy:
            res["accuracy"] = accuracy(args.quick)
            (out / f"tune_chunk_accuracy_{slug}.json").write_text(jsonfmt.dumps(res))
        elif not args.no_tune:
            for key, fn in (("variants", lambda: tune(args.quick)), ("conv", conv_times),
                            ("accuracy", lambda: accuracy(args.quick))):
                res[key] = fn()
                (out / f"tune_chunk_{slug}.json").write_text(jsonfmt.dumps(res))
        if args.bench:
            bench_prefill(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
