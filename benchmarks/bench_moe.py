"""Routed-experts benchmark: our Triton grouped GEMM (``ops.moe``, device-side offsets) with the router's alignment
given (the model's path), old (``main``: the row block and tiles of commit 3743c21, before the TMA kernels) and
new side by side, aligning inside (``inside``), against ``torch._grouped_mm`` driven the same way (what HF
transformers' ``grouped_mm`` experts do) and the per-expert PyTorch loop (our CPU path: a host read of the counts,
~4 launches per expert). ``--impls`` picks the rows; ``--tiles F`` runs the new rows with ``sweep_moe --best F``'s
row block and tiles where F has the shape (through ``moe_experts_triton``'s ``config=``).

Shape: the Qwen3.5-35B-A3B MoE block (hidden 2048, moe_intermediate 512, top-8) with E in {64, 256}
experts, bf16, T in {1, 16, 64, 256, 1024, 4096, 8192} tokens, router probabilities from random logits (8
routings taken in turn up to T = 64, so that a decode call does not find its experts' weights in L2). Each row:
GPU µs (CUDA-graph replay when capturable, else events around back-to-back calls) median [P10-P90], the
achieved weight TB/s (distinct experts hit x 3 H I x 2 bytes, the bytes a decode step must read) and
TFLOP/s (T k 6 H I), and rel-RMS against a float64 reference on the first 8 tokens.

    python -m benchmarks.bench_moe --out benchmarks/results      (CUDA; the tile sweep: benchmarks/sweep_moe.py)
    python -m benchmarks.bench_moe --experts 256 --impls main,new [--tiles best.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import measure_ceilings, time_call
from gdnserve.ops.moe import moe_experts
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe import grouped_triton as gt
from gdnserve.ops.moe.grouped_triton import Config, Tiles, block_rows
from gdnserve.ops.moe.naive import naive_moe_experts
from gdnserve.ops.numerics import rel_rms
from benchmarks import jsonfmt

H, I, K = 2048, 512, 8


def grouped_mm_experts(x, w, idx, gu_t, dn_t):
    """HF-style: sort pairs by expert, torch._grouped_mm with device offsets, index_add back (no host read).
    gu_t [E, H, 2I] and dn_t [E, I, H] are the transposed (k-major) weights _grouped_mm takes."""
    k, E = idx.shape[1], gu_t.shape[0]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x.index_select(0, token), gu_t, offs=offs)
    i2 = h.shape[1] // 2
    y = torch._grouped_mm(F.silu(h[:, :i2]) * h[:, i2:], dn_t, offs=offs) * w.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token, y)


def route_alignment(idx: torch.Tensor, E: int, BM: int | None = None):
    """The alignment the router hands the experts (``router.route``) for these routing ids."""
    return align_pairs(idx, E, BM or block_rows(idx.numel(), E))


def main_tiles(N: int, E: int) -> tuple[int, Config]:
    """Row block and tiles of the grouped GEMM at commit 3743c21 (before the TMA kernels), for old vs new."""
    per = N / E
    BM = 16 if per <= 16 else (32 if per < 32 else (64 if per <= 192 else 128))
    if BM <= 16:
        return BM, Config(Tiles(32, 256, 4, 3), Tiles(64, 128, 4, 3, True))
    if BM == 32 or (BM == 64 and N <= 8192):
        return BM, Config(Tiles(64, 64, 4, 4, True, True), Tiles(128, 64, 4, 3, True))
    if BM == 64:
        return BM, Config(Tiles(64, 64, 4, 3, True), Tiles(128, 64, 4, 3, True))
    return BM, Config(Tiles(128, 64, 8, 3, True, True), Tiles(128, 64, 8, 3, True))




def load_tiles(path: str | None) -> dict[tuple[int, int], tuple[int, Config]]:
    """``sweep_moe --best`` output: {"E,T": [BM, [gate_up tiles], [down tiles], sum_block]} -> the new rows' tiles."""
    if not path:
        return {}
    raw = json.loads(Path(path).read_text())
    return {tuple(map(int, k.split(","))): (v[0], Config(Tiles(*v[1]), Tiles(*v[2]), v[3])) for k, v in raw.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096,8192")
    ap.add_argument("--experts", default="64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impls", default="main,new,inside,grouped_mm,loop",
                    help="rows: main (3743c21 tiles), new (this code), inside (aligns itself), grouped_mm, loop")
    ap.add_argument("--tiles", default=None, help="sweep_moe --best JSON: the new rows' tiles where it has them")
    a = ap.parse_args()
    impls, tiles = a.impls.split(","), load_tiles(a.tiles)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceil = measure_ceilings(dev, quick=True)
    rows = []
    for E in map(int, a.experts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(E)
        gu = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / H ** 0.5).bfloat16()
        dn = (torch.randn(E, H, I, device=dev, generator=gen) / I ** 0.5).bfloat16()
        gu_t, dn_t = gu.transpose(1, 2), dn.transpose(1, 2)      # views: column-major B, as HF passes them
        for T in map(int, a.tokens.split(",")):
            # several routings, taken in turn, so that back-to-back decode calls do not find their experts in L2
            sets = []
            for _ in range(8 if T <= 64 else 1):
                x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
                p, idx = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=gen), -1), K, dim=-1)
                w = (p / p.sum(-1, keepdim=True)).bfloat16()
                bm_new, cfg_new = tiles.get((E, T), (None, None))
                sets.append((x, w, idx, route_alignment(idx, E, bm_new), route_alignment(idx, E, main_tiles(T * K, E)[0])))
            x, w, idx = sets[0][:3]
            hit = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
            bytes_ = hit * 3 * H * I * 2
            flops = T * K * 6 * H * I
            ref = naive_moe_experts(x[:8], w[:8], idx[:8], gu, dn)
            main_cfg = main_tiles(T * K, E)[1]
            variants = {
                "main": ("3743c21 tiles, alignment given", lambda s: gt.moe_experts_triton(
                    s[0], s[1], s[4], gu, dn, K, config=main_cfg)),
                "new": ("new, alignment given" + (" (--tiles)" if cfg_new else ""), lambda s: gt.moe_experts_triton(
                    s[0], s[1], s[3], gu, dn, K, config=cfg_new)),
                "inside": ("new, aligns inside", lambda s: moe_experts(s[0], s[1], s[2], gu, dn, backend="triton")),
                "grouped_mm": ("torch _grouped_mm", lambda s: grouped_mm_experts(s[0], s[1], s[2], gu_t, dn_t)),
                "loop": ("torch loop", lambda s: moe_experts(s[0], s[1], s[2], gu, dn, backend="torch"))}
            for key in impls:
                name, fn = variants[key]
                loop = name == "torch loop"
                try:
                    err = rel_rms(fn(sets[0])[:8], ref)
                    r = time_call(fn, iters=5 if loop else a.iters, warmup=2, rotate=sets[:1] if loop else sets)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                    rows.append({"E": E, "T": T, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    print(rows[-1], flush=True)
                    continue
                g = r["gpu_us"]
                rows.append({"E": E, "T": T, "impl": name, "gpu_us": g, "method": r["gpu_method"],
                             "host_us": r["host_us"], "experts_hit": hit, "TBps": bytes_ / (g["p50"] * 1e-6) / 1e12,
                             "TFLOPs": flops / (g["p50"] * 1e-6) / 1e12, "rel_rms_vs_f64": err})
                print(f"E={E:4d} T={T:5d} {name:32s} {g['p50']:9.1f} us [{g['p10']:.1f}-{g['p90']:.1f}] "
                      f"{rows[-1]['TBps']:.2f} TB/s {rows[-1]['TFLOPs']:.1f} TFLOP/s err {err:.1e} "
                      f"({r['gpu_method']}, host {r['host_us']:.0f} us)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "moe_h200"
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "ceilings": ceil,
            "shape": {"hidden": H, "moe_intermediate": I, "top_k": K, "dtype": "bfloat16"}}
    stem.with_suffix(".json").write_text(jsonfmt.dumps({"meta": meta, "rows": rows}))
    lines = [f"# Routed experts (H={H}, I={I}, top-{K}, bf16) — {meta['device']}", "",
             f"torch {torch.__version__}; ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul "
             f"{ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s. GPU µs median [P10–P90] (CUDA-graph replay, "
             "8 routings in turn up to T = 64). `alignment given`: the model's path (the router hands the "
             "alignment over); `3743c21 tiles`: the row block and tiles before the TMA kernels, same kernels "
             "otherwise; `x vs main`: time / the 3743c21 row's." + (f" `(--tiles)`: tiles from {a.tiles}." if tiles
                                                                  else ""), "",
             "| E | T | impl | GPU µs | weight TB/s (of copy) | TFLOP/s (of bf16) | rel-RMS vs f64 | x vs main |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["E"], r["T"]): r["gpu_us"]["p50"] for r in rows if r["impl"].startswith("3743c21") and "gpu_us" in r}
    for r in rows:
        if "gpu_us" not in r:
            lines.append(f"| {r['E']} | {r['T']} | {r['impl']} | error: {r['error']} | | | | |")
            continue
        g = r["gpu_us"]
        lines.append(f"| {r['E']} | {r['T']} | {r['impl']} | {g['p50']:.1f} [{g['p10']:.1f}–{g['p90']:.1f}] | "
                     f"{r['TBps']:.2f} ({r['TBps'] / ceil['copy_TBps']:.0%}) | {r['TFLOPs']:.1f} "
                     f"({r['TFLOPs'] / ceil['bf16_matmul_TFLOPs']:.0%}) | {r['rel_rms_vs_f64']:.1e} | "
                     f"{g['p50'] / base.get((r['E'], r['T']), float('nan')):.2f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
