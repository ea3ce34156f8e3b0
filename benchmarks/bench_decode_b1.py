"""Decode B=1 pieces on CUDA (issue 15), one process, results written as they come:

  router  the decode router kernel (256 experts top-8 + the shared column, bf16 logits) against another
          checkout's (``--base-root``, e.g. main): ids, weights and alignment compared bit for bit, µs per call
          (inside a CUDA graph of back-to-back calls), warps swept for the one-program path;
  gemv    ``ops.gemv.skinny_linear`` against cuBLAS (``F.linear``) at the model's projection shapes, M = 1..16,
          a sweep of configs over rotating weight copies (cold in L2, as in a step); the winners form the
          ``ops.gemv`` TABLE literal printed in the report (and installed for the step part);
  step    the full-size random-weight Qwen3.5-35B-A3B decode B=1 step (CUDA-graph replays), base pieces
          (the base checkout's router, cuBLAS projections) vs this tree's, each its own ModelRunner on the same
          weights: median wall per step and a torch.profiler kernel table; a third runner with attention's
          output gate folded into o_proj (``gate_folded_forward``, a proposed change of layers/attention.py).

    python -m benchmarks.bench_decode_b1 --out DIR [--base-root PATH] [--parts router,gemv,step]
        [--shapes 2048x4096,...] [--ms 1,2] [--fma-only] [--no-gate-fold]

The step part's A/B swaps, per runner and only while its graphs are captured, ``ops.gemv``'s TABLE (the
override point of the skinny GEMM's dispatch; ``{}`` = cuBLAS everywhere), the router entry point
(``router_triton.route_triton`` <- the base checkout's) and, for the third runner, ``GatedAttention.forward``
(a proposal, not the library's code); the replays then run what was captured.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import jsonfmt
from gdnserve.ops.gemv import SkinnyConfig, skinny_linear, skinny_triton
from gdnserve.ops.moe import router_triton
from gdnserve.ops.numerics import rel_rms

SHAPES = ((2048, 4096, "GDN out_proj / attention o_proj"), (12352, 2048, "GDN in_proj"),
          (9216, 2048, "attention qkv_proj"), (257, 2048, "router gate (+ the shared expert's row)"))
MS = (1, 2, 4, 8, 16)
DOT = [SkinnyConfig(16, 256, 4, 4), SkinnyConfig(16, 512, 4, 3), SkinnyConfig(16, 512, 4, 4),
       SkinnyConfig(16, 128, 4, 6), SkinnyConfig(32, 256, 4, 4), SkinnyConfig(32, 512, 4, 3),
       SkinnyConfig(64, 256, 4, 4), SkinnyConfig(16, 256, 2, 4)]
FMA = [SkinnyConfig(4, 512, 4, 1, False), SkinnyConfig(4, 1024, 4, 1, False), SkinnyConfig(8, 512, 4, 2, False),
       SkinnyConfig(2, 1024, 4, 1, False), SkinnyConfig(8, 1024, 8, 1, False), SkinnyConfig(4, 512, 4, 3, False),
       SkinnyConfig(2, 4096, 4, 1, False), SkinnyConfig(4, 4096, 8, 1, False), SkinnyConfig(1, 4096, 4, 1, False),
       SkinnyConfig(2, 2048, 4, 1, False), SkinnyConfig(4, 2048, 4, 1, False), SkinnyConfig(8, 2048, 8, 1, False),
       SkinnyConfig(4, 2048, 8, 1, False)]
WIN = 0.97                                    # the kernel must beat cuBLAS by 3 % to take a shape


def graph_us(fn, calls: int = 40, reps: int = 7) -> float:
    """µs per call of ``fn(i)`` replayed back to back inside one CUDA graph (median over replays)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[len(ts) // 2]


def load_base_router(root: Path):
    spec = importlib.util.spec_from_file_location("base_router_triton", root / "gdnserve/ops/moe/router_triton.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def part_router(base, log) -> dict:
    dev = torch.device("cuda")
    E, k, H = 256, 8, 2048
    w = (torch.randn(E + 1, H, device=dev) * 0.02).to(torch.bfloat16)
    out = {}
    for T in (1, 2, 4, 8):
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        logits = F.linear(x, w)
        new = router_triton.route_triton(logits, k, True, True)
        row = {"gate GEMM us": graph_us(lambda i: F.linear(x, w))}
        if base is not None:
            old = base.route_triton(logits, k, True, True)
            row["ids equal"] = bool(torch.equal(old.experts, new.experts))
            row["weights bitwise equal"] = bool(torch.equal(old.weights, new.weights))
            row["weights max abs diff"] = float((old.weights.float() - new.weights.float()).abs().max())
            row["alignment equal"] = bool(torch.equal(old.alignment.rows, new.alignment.rows)
                                          and torch.equal(old.alignment.block_expert, new.alignment.block_expert))
            row["base us"] = graph_us(lambda i: base.route_triton(logits, k, True, True))
        for nw in ((1, 2, 4, 8) if T == 1 else (router_triton.SMALL_WARPS[1],)):
            row[f"new us (small path {nw} warps)"] = graph_us(
                lambda i: router_triton.route_triton(logits, k, True, True, small_warps=nw))
        out[f"T={T}"] = row
        log(f"router T={T}: {row}")
    return out


def part_gemv(log, shapes=SHAPES, ms=MS, fma_only: bool = False) -> tuple[dict, dict]:
    dev = torch.device("cuda")
    res, table = {}, {}
    for N, K, what in shapes:
        copies = max(2, -(-(256 << 20) // (N * K * 2)))
        ws = [(torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        entries, rows, wins = [], {}, []
        for M in ms:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            ref = F.linear(x, ws[0])
            r = {"cublas us": graph_us(lambda i: F.linear(x, ws[i % copies]))}
            best = None
            cands = ([] if fma_only and M == 1 else DOT) + (FMA if M == 1 else [])
            for cfg in [c for c in cands if c.BK <= K]:
                y = skinny_linear(x, ws[0], cfg)
                err = rel_rms(y, ref)
                det = bool(torch.equal(y, skinny_linear(x, ws[0], cfg)))
                t = graph_us(lambda i: skinny_linear(x, ws[i % copies], cfg))
                r[str(tuple(cfg))] = {"us": round(t, 2), "rel_rms vs cublas": float(err), "deterministic": det}
                if err < 4e-3 and det and (best is None or t < best[0]):
                    best = (t, cfg)
            gb = N * K * 2 / 1e3
            if best is None:
                log(f"gemv {N}x{K} M={M}: no config passed the checks")
                wins.append(None)
                continue
            r["best"] = {"cfg": tuple(best[1]), "us": round(best[0], 2), "TB/s": round(gb / best[0] / 1e3, 2),
                         "cublas TB/s": round(gb / r["cublas us"] / 1e3, 2)}
            rows[f"M={M}"] = r
            log(f"gemv {N}x{K} M={M}: cublas {r['cublas us']:.2f} us, best {r['best']}")
            wins.append(best[1] if best[0] < WIN * r["cublas us"] else None)
        for M, cfg in zip(ms, wins):          # M-ranges from 1 up, until cuBLAS wins
            if cfg is None:
                break
            if entries and entries[-1][1] == cfg:
                entries[-1] = (M, cfg)
            else:
                entries.append((M, cfg))
        if entries:
            table[(N, K)] = tuple(entries)
        res[f"{N}x{K} ({what})"] = rows
        ws = None
        torch.cuda.empty_cache()
    return res, table


def gate_folded_forward(self, h):
    """``GatedAttention.forward`` with its last line as ``o_proj.forward_gated`` (the proposed one-line change of
    layers/attention.py: the output gate folded into o_proj's skinny GEMM); the rest is attention.py's code."""
    from gdnserve.layers.attention import get_forward_context, paged_attention, store_kv
    ctx = get_forward_context()
    T = h.shape[0]
    QH, KVH, Dh = self.QH, self.KVH, self.Dh
    qkv = self.qkv_proj(h)
    qg = qkv[:, :2 * QH * Dh].view(T, QH, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:]
    k = qkv[:, 2 * QH * Dh:2 * QH * Dh + KVH * Dh].view(T, KVH, Dh)
    v = qkv[:, 2 * QH * Dh + KVH * Dh:].view(T, KVH, Dh)
    q, k = self._norm_rope(q, k, ctx.positions)
    m = ctx.attn
    store_kv(k, v, self.k_cache, self.v_cache, m.slot_mapping, m.token_index, backend=self.backend)
    o = paged_attention(q.contiguous(), self.k_cache, self.v_cache, m.cu_seqlens_q, m.kv_lens, m.page_table,
                        scale=Dh ** -0.5, kv_start=m.kv_start, max_q_len=m.max_q_len,
                        out=torch.zeros(T, QH, Dh, dtype=q.dtype, device=q.device) if m.zero_out else None,
                        backend=self.backend)
    return self.o_proj.forward_gated(o.reshape(T, QH * Dh), gate)


def part_gate(table: dict, log) -> dict:
    """o_proj at M = 1, 2, 4 with attention's output gate: copy + sigmoid + multiply + cuBLAS vs the folded GEMM."""
    dev = torch.device("cuda")
    N, K, G = 2048, 4096, 16
    copies = 8
    ws = [(torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    out = {}
    for M in (1, 2, 4):
        cfg = next((c for b, c in table.get((N, K), ()) if M <= b), None)
        if cfg is None:
            continue
        qg = torch.randn(M, G, 2 * K // G, device=dev).to(torch.bfloat16)
        gate = qg[..., K // G:]
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        ref = F.linear(x * torch.sigmoid(gate.reshape(M, K)), ws[0])
        y = skinny_linear(x, ws[0], cfg, gate=gate)
        out[f"M={M}"] = r = {"cfg": tuple(cfg), "rel_rms vs torch": float(rel_rms(y, ref)),
                             "torch ops + cublas us": graph_us(
                                 lambda i: F.linear(x * torch.sigmoid(gate.reshape(M, K)), ws[i % copies])),
                             "folded us": graph_us(lambda i: skinny_linear(x, ws[i % copies], cfg, gate=gate))}
        log(f"gate fold M={M}: {r}")
    return out


def merge_table(old: dict, new: dict, ms) -> dict:
    """``old`` with each swept shape's ranges up to max(ms) replaced by the sweep's (a shape the sweep gave no
    win keeps its old entries)."""
    out = dict(old)
    for key, entries in new.items():
        out[key] = tuple(entries) + tuple((b, c) for b, c in old.get(key, ()) if b > max(ms))
    return out


def part_step(base, table: dict, log, steps: int = 60, gate_fold: bool = True) -> dict:
    from benchmarks.profile_steps import markdown, profile_steps
    from benchmarks.random_model import build_random_model, config_for
    from gdnserve.engine.cache.sequence import PrefillItem
    from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
    from gdnserve.layers.attention import GatedAttention
    from gdnserve.layers.linear import ColumnParallelLinear, RowParallelLinear
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    hf_cfg = config_for(dev, None, None, full=True)
    model = build_random_model(hf_cfg, dev, torch.bfloat16)
    shapes = sorted({tuple(m.weight.shape) for m in model.modules()
                     if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None})
    log(f"model built in {time.perf_counter() - t0:.1f} s; linear (N, K): {shapes}")
    new_route = router_triton.route_triton
    plain_forward = GatedAttention.forward
    variants = {"base": ({}, base.route_triton if base is not None else new_route, plain_forward),
                "new": (table, new_route, plain_forward), "new + gate fold": (table, new_route, gate_folded_forward)}
    if not gate_fold:
        del variants["new + gate fold"]
    prompt = torch.randint(0, hf_cfg["vocab_size"], (128,), generator=torch.Generator().manual_seed(0)).tolist()
    runners, out, md = {}, {}, []
    for name, (tab, route, fwd) in variants.items():
        skinny_triton.TABLE, router_triton.route_triton, GatedAttention.forward = tab, route, fwd
        runner = ModelRunner(model, RunnerConfig(num_slots=3, num_pages=256, page_size=16, graph_max_tokens=16))
        seq = runner.new_seq()
        tok = int(runner.step([PrefillItem(seq, prompt)], []).argmax(-1)[-1])
        for _ in range(4):
            runner.step([], [(seq, tok)])
        torch.cuda.synchronize()
        runners[name] = (runner, seq, tok)
        log(f"{name}: runner ready at {time.perf_counter() - t0:.1f} s")
    walls = {name: [] for name in variants}
    for _ in range(3):                       # interleaved rounds: drift hits both alike
        for name, (runner, seq, tok) in runners.items():
            for _ in range(steps // 3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.step([], [(seq, tok)])
                torch.cuda.synchronize()
                walls[name].append(1e3 * (time.perf_counter() - t))
    for name, (runner, seq, tok) in runners.items():
        w = sorted(walls[name])
        agg, pwall = profile_steps(lambda: runner.step([], [(seq, tok)]), 5)
        gpu = sum(t for _, t in agg.values())
        n = sum(c for c, _ in agg.values())
        out[name] = {"wall ms median": round(w[len(w) // 2], 3), "wall ms p10": round(w[len(w) // 10], 3),
                     "wall ms p90": round(w[9 * len(w) // 10], 3), "gpu kernel sum ms": round(gpu / 1e3, 3),
                     "kernels per step": round(n), "graph stats": dict(runner.graphs.stats) if runner.graphs else None}
        md += markdown(f"decode B=1 ({name}; wall median {w[len(w) // 2]:.3f} ms over {len(w)} steps)", agg, pwall, 30)
        log(f"step {name}: {out[name]}")
    skinny_triton.TABLE, router_triton.route_triton, GatedAttention.forward = table, new_route, plain_forward
    out["markdown"] = "\n".join(md)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode_b1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--base-root", default=None, help="a checkout whose router kernel is the baseline")
    ap.add_argument("--parts", default="router,gemv,step")
    ap.add_argument("--shapes", default=None, help="gemv shapes NxK,... (default: all of SHAPES)")
    ap.add_argument("--ms", default=None, help="gemv M values, comma-separated (default 1,2,4,8,16); the sweep's "
                                               "winners then replace the committed TABLE's ranges up to max(M)")
    ap.add_argument("--no-gate-fold", action="store_true", help="step: skip the gate-fold runner")
    ap.add_argument("--fma-only", action="store_true", help="gemv: at M = 1 sweep only the CUDA-core configs")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    base = load_base_router(Path(a.base_root)) if a.base_root else None
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    logf = open(out / "log.txt", "a")

    def log(s: str) -> None:
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    def save() -> None:
        (out / "bench_decode_b1.json").write_text(jsonfmt.dumps(res))
    table = dict(skinny_triton.TABLE)

    def guarded(name, fn):
        try:
            fn()
        except Exception:                     # keep the other parts' results
            import traceback
            log(f"part {name} failed:\n{traceback.format_exc()}")
            res[f"{name} error"] = traceback.format_exc()
        save()

    shapes = SHAPES if a.shapes is None else tuple(
        (n, k, w) for n, k, w in SHAPES if f"{n}x{k}" in a.shapes.split(","))
    ms = MS if a.ms is None else tuple(int(m) for m in a.ms.split(","))

    def gemv() -> None:
        nonlocal table
        res["gemv"], swept = part_gemv(log, shapes, ms, a.fma_only)
        table = swept if a.ms is None and a.shapes is None else merge_table(table, swept, ms)
        res["table"] = {f"{n}x{k}": [(m, tuple(c)) for m, c in v] for (n, k), v in table.items()}
        log(f"TABLE = {table!r}")
        if not a.no_gate_fold:
            res["gate fold"] = part_gate(table, log)

    def step() -> None:
        res["step"] = part_step(base, table, log, gate_fold=not a.no_gate_fold)
        (out / "step_profile.md").write_text(res["step"].pop("markdown") + "\n")
    if "router" in parts:
        guarded("router", lambda: res.__setitem__("router", part_router(base, log)))
    if "gemv" in parts:
        guarded("gemv", gemv)
    if "step" in parts:
        guarded("step", step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
