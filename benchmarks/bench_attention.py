"""Paged attention benchmark: the FlashAttention-2-style kernel (``ops/attention/flash_triton.py``, what
``paged_attention`` runs on CUDA) against the first kernel (``paged_triton.py``'s row-wise one), with tile
variants of the new kernel, on Qwen3.5-35B-A3B attention shapes: 16 query heads, 2 KV heads, head dim 256,
16-token pages placed by a random permutation, bf16; decode page tables 256 pages wide (the engine's graphs:
max_model_len 4096 / 16), which sets the flash-decoding split.

Cases: causal prefill 1x4096, 8x1024, 1x512; the checkpoint consumers' case (64 segments x 32 query tokens over
a 600-token prefix held in pages shared by all segments); decode B = 1/16/64/256 at context 128 and 2048.
Each row: GPU µs per call, median [P10-P90] of CUDA-graph replays of n back-to-back calls (n so one replay
lasts ~2 ms; input sets rotated so the KV read does not sit in L2 when it would fit), TFLOP/s (4 Dh QH per
visible (query, key) pair) and TB/s (K/V bytes of the visible positions, each page read once per kv head),
beside the measured ceilings; rel-RMS against float32 SDPA on the device.

    python -m benchmarks.bench_attention --out benchmarks/results        (CUDA)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import measure_ceilings, percentiles
from gdnserve.ops.attention.flash_triton import Config, choose_config, flash_attention_triton, sm_count
from gdnserve.ops.attention.paged_triton import paged_attention_rowwise_triton
from gdnserve.ops.numerics import rel_rms
from benchmarks import jsonfmt

QH, KVH, DH, PS = 16, 2, 256, 16
DT = torch.bfloat16


def build_case(dev, n_seq: int, lq: int, ctx: int, shared_prefix: bool = False, seed: int = 0, width: int = 0):
    """n_seq sequences of lq queries after ctx positions (kv_len = ctx + lq). shared_prefix: every sequence's
    first ctx // PS pages are the same physical pages (consumers of one checkpoint). width: the page table's
    width (at least the pages needed; the engine's graphs use max_model_len / PS, 256)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    L = ctx + lq
    per = math.ceil(L / PS)
    shared = ctx // PS if shared_prefix else 0
    num_pages = shared + n_seq * (per - shared)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(n_seq, max(per, width), dtype=torch.int32)
    table[:, :shared] = perm[:shared]
    table[:, shared:per] = perm[shared:].view(n_seq, per - shared)
    kc = torch.randn(num_pages, PS, KVH, DH, device=dev, dtype=DT)
    vc = torch.randn(num_pages, PS, KVH, DH, device=dev, dtype=DT)
    q = torch.randn(n_seq * lq, QH, DH, device=dev, dtype=DT)
    cu = torch.arange(0, (n_seq + 1) * lq, lq, dtype=torch.int32, device=dev)
    kv = torch.full((n_seq,), L, dtype=torch.int32, device=dev)
    return dict(q=q, kc=kc, vc=vc, cu=cu, kv=kv, table=table.to(dev), n=n_seq, lq=lq, L=L,
                pages=num_pages)


def reference(c) -> torch.Tensor:
    """float32 SDPA over each sequence's gathered K/V (all sequences have the same shape here)."""
    n, lq, L = c["n"], c["lq"], c["L"]
    t = c["table"].long()
    per = math.ceil(L / PS)
    k = c["kc"][t[:, :per]].view(n, -1, KVH, DH)[:, :L].float()
    v = c["vc"][t[:, :per]].view(n, -1, KVH, DH)[:, :L].float()
    q = c["q"].float().view(n, lq, QH, DH).transpose(1, 2)
    k = k.transpose(1, 2).repeat_interleave(QH // KVH, 1)
    v = v.transpose(1, 2).repeat_interleave(QH // KVH, 1)
    i = torch.arange(lq, device=q.device)[:, None] + (L - lq)
    mask = torch.arange(L, device=q.device)[None, :] <= i
    outs = []
    for b0 in range(0, n, 16):
        outs.append(F.scaled_dot_product_attention(q[b0:b0 + 16], k[b0:b0 + 16], v[b0:b0 + 16], attn_mask=mask,
                                                   scale=DH ** -0.5))
    return torch.cat(outs).transpose(1, 2).reshape(n * lq, QH, DH)


def work(c) -> tuple[float, float]:
    """FLOPs (visible pairs x 4 Dh QH) and K/V bytes (visible positions x KVH x Dh x 2 tensors x 2 bytes;
    shared pages counted once)."""
    n, lq, L = c["n"], c["lq"], c["L"]
    pairs = n * sum(L - lq + i + 1 for i in range(lq))
    return pairs * 4 * DH * QH, c["pages"] * PS * KVH * DH * 2 * 2


def runner(c, variant):
    out = torch.empty_like(c["q"])
    args = (c["q"], c["kc"], c["vc"], c["cu"], c["kv"], c["table"], DH ** -0.5, out)
    if variant == "old":
        return (lambda: paged_attention_rowwise_triton(*args, max_q_len=c["lq"])), out
    cfg = None if variant == "new" else variant
    return (lambda: flash_attention_triton(*args, max_q_len=c["lq"], config=cfg)), out


def graph_times(calls, target_us: float, replays: int = 25) -> list[float]:
    for f in calls:
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for f in calls:
        f()
    e.record()
    e.synchronize()
    per = s.elapsed_time(e) * 1000 / len(calls)
    reps = max(1, min(64, round(target_us / max(per, 1e-3) / len(calls))))
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in calls:
                f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / (reps * len(calls)))
    return ts


CASES = [  # name, n_seq, lq, ctx, shared prefix
    ("prefill 1x4096", 1, 4096, 0, False), ("prefill 8x1024", 8, 1024, 0, False),
    ("prefill 1x512", 1, 512, 0, False), ("consumers 64x32 over 600", 64, 32, 600, True),
    *[(f"decode B={b} ctx {L}", b, 1, L - 1, False) for L in (128, 2048) for b in (1, 16, 64, 256)],
]
PREFILL_VARIANTS = [Config(128, 64, 8, 2), Config(128, 64, 8, 3), Config(128, 32, 8, 3), Config(64, 64, 4, 2)]
DECODE_VARIANTS = [Config(16, 64, 4, 2), Config(16, 32, 4, 3), Config(16, 128, 4, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--long-decode", action="store_true",
                    help="only decode B = 1, 16 at context 8,192 under the 9,216-token table of the HTTP run "
                         "(bench_serve_http's --max-model-len): the flash-decoding split sizes side by side")
    ap.add_argument("--warm", default=None, help="k/N: only compile (one call each) every N-th variant from the "
                    "k-th, to fill Triton's cache from N processes in parallel before the timed run")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.warm:
        warm(dev, *map(int, a.warm.split("/")))
        return
    ceil = measure_ceilings(dev, quick=True)
    print("ceilings", ceil, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(dev), torch=torch.__version__, ceilings=ceil,
                shape=dict(QH=QH, KVH=KVH, Dh=DH, page_size=PS, dtype="bf16"))
    rows = []
    for name, n, lq, ctx, shared in (LONG_CASES if a.long_decode else CASES):
        width = (9216 if "ctx 8192" in name else 4096) // PS if lq == 1 else 0   # decode: the graphs' table width
        base = build_case(dev, n, lq, ctx, shared, width=width)
        flops, kv_bytes = work(base)
        ref = reference(base)
        n_sets = max(1, min(8, math.ceil(120e6 / (kv_bytes + base["q"].numel() * 4))))
        sets = [base] + [build_case(dev, n, lq, ctx, shared, seed=s, width=width) for s in range(1, n_sets)]
        auto = choose_config(lq, QH // KVH, DH, 2, base["table"].shape[1] * PS, n, KVH, sm_count(dev))
        variants = long_variants(auto) if a.long_decode else variants_for(lq, a.no_variants)
        for var in variants:
            if isinstance(var, Config) and not var.split and (
                    var.BM, var.BN, var.num_warps, var.num_stages) == (
                    auto.BM, auto.BN, auto.num_warps, auto.num_stages):
                continue                                      # the default's tiles: the "new" row
            label = var if isinstance(var, str) else f"BM{var.BM} BN{var.BN} w{var.num_warps} s{var.num_stages}"
            if isinstance(var, Config) and var.split:
                label += f" split {var.split}x{var.n_split}"
            try:
                if isinstance(var, Config) and auto.n_split > 1 and not var.split:   # the tiles with the auto split
                    var = Config(var.BM, var.BN, var.num_warps, var.num_stages, auto.split, auto.n_split)
                f0, out = runner(base, var)
                f0()
                torch.cuda.synchronize()
                err = rel_rms(out, ref)
                ts = graph_times([runner(c, var)[0] for c in sets], 2000.0)
            except Exception as e:  # noqa: BLE001 - a tile config out of resources is a result, not a crash
                rows.append(dict(case=name, variant=label, error=f"{type(e).__name__}: {e}"[:200]))
                print(name, label, "ERROR", rows[-1]["error"], flush=True)
                torch.cuda.synchronize()
                continue
            p = percentiles(ts)
            r = dict(case=name, variant=label, us=p, tflops=flops / (p["p50"] * 1e-6) / 1e12,
                     tbps=kv_bytes / (p["p50"] * 1e-6) / 1e12, rel_rms=err, n_sets=n_sets,
                     config=str(auto) if label == "new" else None)
            rows.append(r)
            print(f"{name:28s} {label:22s} {p['p50']:9.1f} us [{p['p10']:.1f}-{p['p90']:.1f}] "
                  f"{r['tflops']:7.1f} TFLOP/s {r['tbps']:6.3f} TB/s err {err:.2e}", flush=True)
        del sets, base, ref
        torch.cuda.empty_cache()
        stem = "attention_long_decode_h200" if a.long_decode else "attention_h200"
        (a.out / f"{stem}.json").write_text(jsonfmt.dumps(dict(meta=meta, rows=rows)))
        (a.out / f"{stem}.md").write_text(markdown(meta, rows))   # after every case: partial runs count


LONG_CASES = [(f"decode B={b} ctx 8192", b, 1, 8191, False) for b in (1, 16)]


def long_variants(auto: Config) -> list:
    """The auto config and 2x / 4x / 8x longer pieces."""
    out: list = ["old", "new"]
    cap = auto.split * auto.n_split
    for f in (2, 4, 8):
        split = auto.split * f
        if auto.n_split > 1 and split < cap:
            out.append(Config(auto.BM, auto.BN, auto.num_warps, auto.num_stages, split, -(-cap // split)))
    return out


def variants_for(lq: int, no_variants: bool = False) -> list:
    return ["old", "new"] + ([] if no_variants else (PREFILL_VARIANTS if lq > 1 else DECODE_VARIANTS))


def warm(dev, k: int, n_proc: int) -> None:
    for name, n, lq, ctx, shared in CASES:
        c = build_case(dev, n, lq, ctx, shared, width=4096 // PS if lq == 1 else 0)
        auto = choose_config(lq, QH // KVH, DH, 2, c["table"].shape[1] * PS, n, KVH, sm_count(dev))
        for i, var in enumerate(variants_for(lq)):
            if i % n_proc != k:
                continue
            if isinstance(var, Config) and auto.n_split > 1:
                var = Config(var.BM, var.BN, var.num_warps, var.num_stages, auto.split, auto.n_split)
            try:
                runner(c, var)[0]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - the timed run reports it
                print("warm", name, var, type(e).__name__, flush=True)


def markdown(meta, rows) -> str:
    c = meta["ceilings"]
    lines = [f"# Paged attention on {meta['device']} ({meta['date']}, torch {meta['torch']})", "",
             "`python -m benchmarks.bench_attention --out benchmarks/results`: QH 16, KVH 2, Dh 256, 16-token pages, "
             f"bf16. Ceilings measured: bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s, copy "
             f"{c['copy_TBps']:.2f} TB/s. GPU µs per call, median [P10-P90] of CUDA-graph replays; rel-RMS vs "
             "float32 SDPA. `old` = the row-wise kernel, `new` = the default config of flash_triton.py.", "",
             "| case | variant | µs | TFLOP/s | TB/s | rel-RMS |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | {r['error'][:80]} | | | |")
            continue
        u = r["us"]
        lines.append(f"| {r['case']} | {r['variant']}{' (' + r['config'] + ')' if r.get('config') else ''} | "
                     f"{u['p50']:.1f} [{u['p10']:.1f}-{u['p90']:.1f}] | {r['tflops']:.1f} | {r['tbps']:.3f} | "
                     f"{r['rel_rms']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
