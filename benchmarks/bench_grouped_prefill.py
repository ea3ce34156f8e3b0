"""Grouped-prefill benchmark: one GDN layer's prefill core (conv + gates + gated delta rule) for one
shared prefix and N continuations, through ``gdn_prefill_core`` with the plan of each executor.

Run ``gdnserve bench grouped-prefill`` or ``python -m benchmarks.bench_grouped_prefill`` (options:
--device, --quick, --out, --no-fla, --modes). Writes ``grouped_prefill_<device>_<date>.json``, ``.md``
and ``.png`` (latency vs consumers; needs matplotlib, the ``bench`` extra) to --out.

Workloads: ``1P512+16C64`` is one producer of 512 tokens from zeros writing a checkpoint slot and 16
consumers of 64 tokens each, every consumer starting from the producer's final state
(``InitFrom.PRODUCER``) and writing its own private slot; ``4P512x8C64`` is 4 such producers with 8
consumers each. Segments are listed producers first, so every executor sees the one token layout
(step_plan.py). On CUDA: 1P512 + {1, 2, 4, 8, 16}C64, 1P4096 + {16, 64}C256 and 4P512x8C64 at the
Qwen3.5-35B-A3B GDN shape (H=16, HV=32, K=V=128, W=4, D=8192), bf16 activations, fp32 SSM pool
``[S, HV, V, K]``, bf16 conv pool ``[S, W-1, D]``, Triton kernels. On CPU: H=2, HV=4, K=V=16 (D=128),
producers of 64 and consumers of 16 tokens, the PyTorch path: a smoke test of the executors and this
harness, not a performance figure. Inputs are fresh random data; pools start random, so a slot an
executor forgets to write shows up in the correctness column.

Each executor's plan is built once per input set with ``build_step_plan`` (its own ``IndexStager``:
the staged device buffer is refilled in place, so plans must not share one) and the host cost of
building it is timed on its own ("plan µs"), not inside the executor time. Executor times are
``benchmarks.timing.time_call``: **call** = CUDA events around the Python call with the GPU idle
before it (what the targets name: eager, host cost included) and **graph** = the same call replayed in
a CUDA graph (GPU time; ``batched_events`` when capture fails, with the reason in the notes). Inputs
rotate over enough sets to exceed 3x L2. Medians with P10~P90.

Rows also carry: **plain**, one ordinary prefill of a single sequence of the same token count (the
1P512+1C64 target compares fused to it); **fla two-phase**, the reference method with fla 0.6.0 as
``../shared/anchors/fla_anchor.py``'s ``phased`` runs it (producers packed in one causal_conv1d +
chunk_gated_delta_rule call writing checkpoint rows, then ``index_select`` of those rows, the consumers
packed in one call, ``index_copy_`` into private slots; fla called as ``bench_ops.Fla`` does, with
precomputed chunk indices and in-kernel gates) measured in the same run, and the rel-RMS of our fused
consumer outputs and states against fla's; **max |Δ| vs serial**, the largest absolute difference of
any executor's outputs, destination conv states and SSM states to ``serial`` on one input set (all
four run the same arithmetic in the same order: expect exactly 0).

Essential bytes (each input read once, each output written once, a pool state read only where a
segment starts from a slot of an earlier step, written once per destination; s_a = activation
bytes, s_c = conv pool bytes, s_s = SSM pool bytes, N_src = segments starting from a pool slot
(OWN_SLOT / CHECKPOINT; 0 in these workloads: a consumer of a same-step producer gets its state inside
the step), N_dst = segments with a destination slot (producers + consumers)):

    bytes = T (D + 2 HV) s_a            x, a, b read
          + T HV V s_a                  o written
          + D W s_a                     conv weight read
          + (N_src + N_dst) ((W-1) D s_c + HV V K s_s)    conv + SSM states

FLOPs are bench_ops' essential counts (conv 2 W T D + chunk prefill, gdn_kernels.md §2.3) over all T
tokens. floor = max(bytes / copy rate, FLOPs / bf16 rate), with both ceilings measured in this run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from benchmarks import jsonfmt
from benchmarks.bench_ops import (
    QWEN35_GDN,
    Dims,
    Fla,
    _err,
    _git,
    _layer_params,
    _pct,
    _versions,
    chunk_cost,
    conv_cost,
    device_name,
    device_slug,
    load_fla,
    rel_rms,
    resolve_device,
    split_qkv,
)
from benchmarks.timing import host_time, measure_ceilings, time_call

ACT, STATE, CONV = torch.bfloat16, torch.float32, torch.bfloat16
CPU_DIMS = Dims(H=2, HV=4, K=16, V=16, W=4)
ALL_MODES = ("serial", "two_phase", "two_phase_indexed", "fused")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    Progress.clear()
    print(f"[bench grouped-prefill {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Progress:
    """One-line counter on stderr (``\\r``-rewritten on a terminal, one line per step in a log)."""
    _live = False

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        n = 24 * self.done // max(self.total, 1)
        line = f"[{'#' * n}{'.' * (24 - n)}] {self.done}/{self.total} {what}"
        if self.tty:
            print(f"\r{line[:110]:<110}", end="", file=sys.stderr, flush=True)
            Progress._live = True
        else:
            print(f"[bench grouped-prefill {time.perf_counter() - _T0:6.1f}s] {line}", file=sys.stderr, flush=True)

    @staticmethod
    def clear() -> None:
        if Progress._live:
            print(file=sys.stderr, flush=True)
            Progress._live = False


# ------------------------------------------------------------------------------------------ workloads

@dataclass(frozen=True)
class Workload:
    producers: int
    consumers: int     # per producer
    prefix: int        # tokens per producer
    suffix: int        # tokens per consumer

    @property
    def label(self) -> str:
        if self.producers == 1:
            return f"1P{self.prefix}+{self.consumers}C{self.suffix}"
        return f"{self.producers}P{self.prefix}x{self.consumers}C{self.suffix}"

    @property
    def total_consumers(self) -> int:
        return self.producers * self.consumers

    @property
    def num_segments(self) -> int:
        return self.producers + self.total_consumers

    @property
    def producer_tokens(self) -> int:
        return self.producers * self.prefix

    @property
    def tokens(self) -> int:
        return self.producer_tokens + self.total_consumers * self.suffix

    def segments(self, slot0: int) -> list[Any]:
        """Producers (zeros -> checkpoint slot slot0 + p), then consumers (producer -> private slot)."""
        from gdnserve.engine.execution.step_plan import InitFrom, PrefillSegment
        segs = [PrefillSegment(self.prefix, InitFrom.ZEROS, slot0 + p, request=f"P{p}") for p in range(self.producers)]
        C = self.consumers
        segs += [PrefillSegment(self.suffix, InitFrom.PRODUCER, slot0 + self.producers + j, producer=j // C,
                                request=f"P{j // C}C{j % C}") for j in range(self.total_consumers)]
        return segs


@dataclass(frozen=True)
class Setup:
    dims: Dims
    workloads: tuple[Workload, ...]
    iters: int
    warmup: int
    host_iters: int
    backend: str


def make_setup(cuda: bool, quick: bool) -> Setup:
    if cuda:
        short = [Workload(1, n, 512, 64) for n in ((1, 16) if quick else (1, 2, 4, 8, 16))]
        long = [Workload(1, n, 4096, 256) for n in ((64,) if quick else (16, 64))]
        multi = [] if quick else [Workload(4, 8, 512, 64)]
        it = (20, 2, 50) if quick else (50, 3, 200)
        return Setup(QWEN35_GDN, tuple(short + long + multi), *it, backend="auto")
    n_c = (1, 4) if quick else (1, 4, 16)
    wl = [Workload(1, n, 64, 16) for n in n_c] + [Workload(2, 2 if quick else 4, 64, 16)]
    return Setup(CPU_DIMS, tuple(wl), *((5, 1, 5) if quick else (10, 2, 10)), backend="torch")


def essential_bytes(d: Dims, segs: list[Any], T: int, s_a: int, s_c: int, s_s: int) -> int:
    """The module docstring's formula."""
    from gdnserve.engine.execution.step_plan import InitFrom
    n_src = sum(s.init in (InitFrom.OWN_SLOT, InitFrom.CHECKPOINT) for s in segs)
    n_dst = sum(s.dst_slot >= 0 for s in segs)
    state = (d.W - 1) * d.D * s_c + d.HV * d.V * d.K * s_s
    return T * (d.D + 2 * d.HV) * s_a + T * d.HV * d.V * s_a + d.D * d.W * s_a + (n_src + n_dst) * state


def essential_flops(d: Dims, T: int, n_seqs: int) -> int:
    return conv_cost(d, T, n_seqs)[1] + chunk_cost(d, T, n_seqs)[1]


def stager_capacity(wl: Workload, modes: tuple[str, ...]) -> int:
    """The int32s one plan of this workload stages, the most over ``modes``: measured by building each plan
    once into a host-side stager (every packed vector starts 16-byte aligned, so a count of vector lengths
    alone comes up short: 4P512x8C64 needed 904 ints against a formula's 896)."""
    from gdnserve.engine.execution.step_plan import IndexStager, build_step_plan

    class Counting(IndexStager):
        used = 0

        def upload(self, vals):
            self.used = max(self.used, len(vals))
            return super().upload(vals)

    probe = Counting(1 << 22, "cpu")
    for mode in modes:
        build_step_plan(wl.segments(0), mode, probe)
    return probe.used


# ------------------------------------------------------------------------------------------------ case

@dataclass
class Impl:
    name: str                              # serial | two_phase | ... | plain | fla two-phase
    fn: Callable[[Any], Any]


@dataclass
class Case:
    wl: Workload
    nbytes: int
    flops: int
    sets: list[Any]
    impls: list[Impl]
    plan_fns: dict[str, Callable[[], Any]]     # mode -> one build_step_plan call (host-timed)
    check: Callable[[], dict[str, Any]]


def build_case(wl: Workload, setup: Setup, modes: tuple[str, ...], device: torch.device, fla: Fla | None,
               l2_bytes: int) -> Case:
    from gdnserve.engine.execution.step_plan import IndexStager, InitFrom, PrefillSegment, build_step_plan
    from gdnserve.layers.gdn_prefill import GDNCoreParams, gdn_prefill_core
    from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
    d, dev, cuda = setup.dims, device, device.type == "cuda"
    T, n_seg, Tp = wl.tokens, wl.num_segments, wl.producer_tokens
    nbytes = essential_bytes(d, wl.segments(0), T, ACT.itemsize, CONV.itemsize, STATE.itemsize)
    n_sets = 1 if not cuda else max(1, min(16, math.ceil(3 * l2_bytes / nbytes)))
    S = n_sets * n_seg
    lp = _layer_params(d, dev)
    p = GDNCoreParams(conv_weight=lp.conv_w, A_log=lp.A_log, dt_bias=lp.dt_bias, H=d.H, HV=d.HV, K=d.K, V=d.V)
    ssm_pool = (torch.randn(S, d.HV, d.V, d.K, device=dev) * 0.05).to(STATE)
    conv_pool = torch.randn(S, d.W - 1, d.D, device=dev).to(CONV)
    cap = stager_capacity(wl, modes)
    chunk_rows = sum(max(1, -(-n // 64)) for n in [wl.prefix] * wl.producers + [wl.suffix] * wl.total_consumers)
    ws = ChunkWorkspace.empty(T, max(chunk_rows, -(-T // 64)), d.HV, d.K, d.V, ACT, dev) if cuda else None
    sets = []
    for i in range(n_sets):
        segs = wl.segments(i * n_seg)
        s = SimpleNamespace(segs=segs, slots=torch.arange(i * n_seg, (i + 1) * n_seg, device=dev),
                            x=torch.randn(T, d.D, device=dev).to(ACT), a=torch.randn(T, d.HV, device=dev).to(ACT),
                            b=torch.randn(T, d.HV, device=dev).to(ACT),
                            o=torch.empty(T, d.HV, d.V, device=dev, dtype=ACT),
                            y=torch.empty(T, d.D, device=dev, dtype=ACT), plans={}, stagers=[])
        for mode in modes:   # each plan keeps its own stager (and its pinned staging) alive
            s.stagers.append(IndexStager(cap, dev))
            sp = build_step_plan(segs, mode, s.stagers[-1])
            if sp.order != tuple(range(n_seg)):
                raise RuntimeError(f"{wl.label} {mode}: unexpected token order {sp.order}")
            s.plans[mode] = sp.prefill
        s.stagers.append(IndexStager(64 + 4 * -(-T // 64), dev))
        s.plans["plain"] = build_step_plan([PrefillSegment(T, InitFrom.ZEROS, i * n_seg)], "fused",
                                           s.stagers[-1]).prefill
        sets.append(s)

    def run(plan_name: str) -> Callable[[Any], torch.Tensor]:
        def fn(s: Any) -> torch.Tensor:
            return gdn_prefill_core(s.x, s.a, s.b, p, conv_pool, ssm_pool, s.plans[plan_name], out=s.o,
                                    conv_out=s.y, workspace=ws, backend=setup.backend)
        return fn

    impls = [Impl(m, run(m)) for m in modes] + [Impl("plain", run("plain"))]
    scratch = IndexStager(cap, dev)
    plan_fns = {m: (lambda m=m: build_step_plan(sets[0].segs, m, scratch)) for m in modes}

    fla_fn = None
    if fla is not None:
        fla_ssm = torch.zeros(S, d.HV, d.V, d.K, device=dev, dtype=STATE)
        fla_conv = torch.zeros(S, d.D, d.W, device=dev, dtype=CONV)
        cu_p, ci_p = fla.varlen([wl.prefix] * wl.producers, dev)
        cu_c, ci_c = fla.varlen([wl.suffix] * wl.total_consumers, dev)
        for s in sets:
            s.ckpt = s.slots[:wl.producers]
            s.src = s.ckpt.repeat_interleave(wl.consumers)
            s.priv = s.slots[wl.producers:]

        def fla_two_phase(s: Any) -> tuple[torch.Tensor, torch.Tensor]:
            y, cf = fla.conv(s.x[:Tp][None], p.conv_weight, None, cu_p, ci_p)
            q, k, v = split_qkv(y, d)
            o_p, st = fla.chunk(q, k, v, s.a[:Tp][None], s.b[:Tp][None], p.A_log, p.dt_bias, None, cu_p, ci_p)
            fla_ssm.index_copy_(0, s.ckpt, st)
            fla_conv.index_copy_(0, s.ckpt, cf)
            y, cf = fla.conv(s.x[Tp:][None], p.conv_weight, fla_conv.index_select(0, s.src), cu_c, ci_c)
            q, k, v = split_qkv(y, d)
            o_c, st = fla.chunk(q, k, v, s.a[Tp:][None], s.b[Tp:][None], p.A_log, p.dt_bias,
                                fla_ssm.index_select(0, s.src), cu_c, ci_c)
            fla_ssm.index_copy_(0, s.priv, st)
            fla_conv.index_copy_(0, s.priv, cf)
            return o_p, o_c

        fla_fn = fla_two_phase
        impls.append(Impl("fla two-phase", fla_fn))

    def check() -> dict[str, Any]:
        """Every mode on set 0 from the same pool contents: max |Δ| to serial; fused vs fla."""
        s = sets[0]
        snap = (conv_pool.clone(), ssm_pool.clone())
        got = {}
        for m in modes:
            conv_pool.copy_(snap[0])
            ssm_pool.copy_(snap[1])
            s.o.fill_(float("nan"))
            run(m)(s)
            got[m] = (s.o.clone(), conv_pool[s.slots].clone(), ssm_pool[s.slots].clone())
        out: dict[str, Any] = {"max_abs_diff_vs_serial": {}}
        for m in modes[1:]:
            diffs = [float("inf") if not torch.isfinite(a).all() else (a.double() - b.double()).abs().max().item()
                     for a, b in zip(got[m], got["serial"])]
            out["max_abs_diff_vs_serial"][m] = max(diffs)
        out["serial_finite"] = all(bool(torch.isfinite(t).all()) for t in got["serial"])
        if fla_fn is not None and "fused" in got:
            o_p, o_c = fla_fn(s)
            o, conv, ssm = got["fused"]
            nP = wl.producers
            out["fla_rel_rms"] = {
                "o_consumers": rel_rms(o[Tp:], o_c[0]), "o_producers": rel_rms(o[:Tp], o_p[0]),
                "state_consumers": rel_rms(ssm[nP:], fla_ssm[s.priv]),
                "conv_state_consumers": rel_rms(conv[nP:], fla_conv[s.priv][:, :, 1:].transpose(1, 2))}
        return out

    return Case(wl, nbytes, essential_flops(d, T, n_seg), sets, impls, plan_fns, check)


# --------------------------------------------------------------------------------------------- running

def run_case(case: Case, setup: Setup, device: torch.device, ceilings: dict[str, Any], progress: Progress,
             errors: list[dict[str, str]]) -> dict[str, Any]:
    wl = case.wl
    row: dict[str, Any] = {"workload": wl.label, "producers": wl.producers, "consumers": wl.total_consumers,
                           "consumers_per_producer": wl.consumers, "prefix": wl.prefix, "suffix": wl.suffix,
                           "tokens": wl.tokens, "bytes": case.nbytes, "flops": case.flops,
                           "n_inputs": len(case.sets), "times": {}, "plan_host_us": {}}
    row["floor_us"] = 1e6 * max(case.nbytes / (ceilings["copy_TBps"] * 1e12),
                                case.flops / (ceilings["bf16_matmul_TFLOPs"] * 1e12))
    progress.step(f"{wl.label}: correctness")
    try:
        row.update(case.check())
        diffs = row["max_abs_diff_vs_serial"].values()
        row["max_diff"] = max(diffs) if diffs else None
    except Exception as e:  # noqa: BLE001 — one broken executor must not end the run
        errors.append({"where": f"{wl.label} check", "error": _err(e)})
        log(f"{wl.label}: check FAILED: {_err(e)}")
        traceback.print_exc(file=sys.stderr)
    for impl in case.impls:
        progress.step(f"{wl.label}: timing {impl.name}")
        try:
            row["times"][impl.name] = time_call(impl.fn, iters=setup.iters, warmup=setup.warmup, rotate=case.sets,
                                                host_iters=setup.host_iters, device=device)
        except Exception as e:  # noqa: BLE001
            row["times"][impl.name] = {"error": _err(e)}
            errors.append({"where": f"{wl.label} {impl.name}", "error": _err(e)})
            log(f"{wl.label}: {impl.name} FAILED: {_err(e)}")
            traceback.print_exc(file=sys.stderr)
    progress.step(f"{wl.label}: plan build")
    for mode, fn in case.plan_fns.items():
        try:
            row["plan_host_us"][mode] = host_time(fn, iters=max(setup.host_iters, 3), device=device)
        except Exception as e:  # noqa: BLE001
            errors.append({"where": f"{wl.label} plan {mode}", "error": _err(e)})
    t = row["times"]
    call = lambda name: t.get(name, {}).get("call_us", {}).get("p50")  # noqa: E731
    graph = lambda name: (t.get(name, {}).get("gpu_us", {}).get("p50")  # noqa: E731
                          if t.get(name, {}).get("gpu_method") == "cuda_graph" else None)
    if call("serial") and call("fused"):
        row["speedup"] = call("serial") / call("fused")
    if call("fused") and call("plain"):
        row["fused_over_plain"] = call("fused") / call("plain")
    if call("fused") and call("fla two-phase"):
        row["fused_over_fla"] = call("fused") / call("fla two-phase")
    for tag, v in (("eager", call("fused")), ("graph", graph("fused"))):
        if v:
            row[f"fused_{tag}_TBps"] = case.nbytes / (v * 1e-6) / 1e12
            row[f"fused_{tag}_pct_copy"] = 100 * row[f"fused_{tag}_TBps"] / ceilings["copy_TBps"]
            row[f"fused_{tag}_TFLOPs"] = case.flops / (v * 1e-6) / 1e12
            row[f"fused_{tag}_x_floor"] = v / row["floor_us"]
    return row


TARGETS = (  # name, unit, goal, higher is better (issue 3, H200, one GDN layer)
    ("1P512+16C64: fused <= 100 µs eager", "µs", 100.0, False),
    ("1P512+16C64: fused <= 50 µs as a replayed CUDA graph", "µs", 50.0, False),
    ("1P512+16C64: fused >= 10x over our serial", "x", 10.0, True),
    ("1P512+1C64: fused within 1.2x of one plain prefill of 576 tokens", "x", 1.2, False),
    ("fused latency growth 1P512+1C64 -> 1P512+16C64 <= 25 %", "%", 25.0, False),
    ("1P4096+64C256: fused <= 1000 µs eager", "µs", 1000.0, False),
)


def evaluate_targets(rows: list[dict[str, Any]], applicable: bool) -> list[dict[str, Any]]:
    """pass / miss / gap per target, with the measured numbers that say why (``detail``)."""
    by = {r["workload"]: r for r in rows}

    def tm(wl: str, impl: str, graph: bool = False) -> float | None:
        r = by.get(wl, {}).get("times", {}).get(impl, {})
        if graph and r.get("gpu_method") != "cuda_graph":
            return None
        return r.get("gpu_us" if graph else "call_us", {}).get("p50")

    def us(v: float | None) -> str:
        return "—" if v is None else f"{v:.0f} µs"

    W1, W16, WL = "1P512+1C64", "1P512+16C64", "1P4096+64C256"
    f1, f16, fl = tm(W1, "fused"), tm(W16, "fused"), tm(WL, "fused")
    g1, g16, gl = tm(W1, "fused", True), tm(W16, "fused", True), tm(WL, "fused", True)
    s16, p1, pg1 = tm(W16, "serial"), tm(W1, "plain"), tm(W1, "plain", True)
    floor16 = by.get(W16, {}).get("floor_us")
    cap_err = by.get(W16, {}).get("times", {}).get("fused", {}).get("graph_error")
    measured = [  # (value, detail)
        (f16, f"as a graph {us(g16)}: host/launch cost {us(f16 - g16 if f16 and g16 else None)}"),
        (g16, f"memory floor {us(floor16)}" + (f"; capture failed: {cap_err}" if cap_err else "")),
        (s16 / f16 if s16 and f16 else None, f"serial {us(s16)}, fused {us(f16)}"),
        (f1 / p1 if f1 and p1 else None, f"fused {us(f1)}, plain {us(p1)}; as graphs {us(g1)} vs {us(pg1)}"),
        (100 * (f16 / f1 - 1) if f16 and f1 else None,
         f"eager {us(f1)} -> {us(f16)}; as graphs {us(g1)} -> {us(g16)}"),
        (fl, f"as a graph {us(gl)}; fla two-phase {us(tm(WL, 'fla two-phase'))}"),
    ]
    out = []
    for (name, unit, goal, higher), (v, detail) in zip(TARGETS, measured):
        t: dict[str, Any] = {"target": name, "goal": goal, "unit": unit, "value": None, "result": "not measured"}
        if not applicable:
            t["result"] = "n/a (targets are for the Qwen3.5 shape on the H200)"
        elif v is not None:
            ok = v >= goal if higher else v <= goal
            t.update(value=v, result="pass" if ok else "miss", gap=v - goal, detail=detail)
            if unit != "%":
                t["gap_pct"] = 100 * (v - goal) / goal
        else:
            t["detail"] = detail
        out.append(t)
    return out


# --------------------------------------------------------------------------------------------- reports

def _t(row: dict[str, Any], impl: str, kind: str = "call_us") -> str:
    r = row["times"].get(impl)
    if r is None:
        return "—"
    if "error" in r:
        return "error"
    if kind == "gpu_us" and r.get("gpu_method") != "cuda_graph":
        return "—" if r.get("gpu_method") == "cpu_wall" else "— (capture failed)"
    return _pct(r[kind])


def _f(v: Any, fmt: str, suffix: str = "") -> str:
    return "—" if v is None else format(v, fmt) + suffix


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    L = ["## Targets", "", "| target | measured | result | gap | measured beside it |",
         "| --- | --- | --- | --- | --- |"]
    for t in targets:
        val = "—" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        gap = "—" if t.get("gap") is None else f"{t['gap']:+.2f} {t['unit']}"
        if t.get("gap_pct") is not None:
            gap += f" ({t['gap_pct']:+.0f} %)"
        L.append(f"| {t['target']} | {val} | {t['result']} | {gap} | {t.get('detail', '—').replace('|', '/')} |")
    return L


def to_markdown(res: dict[str, Any]) -> str:
    c, d, cuda = res["ceilings"], res["dims"], res["device_slug"] != "cpu"
    modes = res["modes"]
    L = [f"# Grouped prefill — {res['device']}, {res['date']}", "",
         f"torch {res['torch']}, triton {res['triton']}, fla {res['fla'] or '—'}, gdnserve {res['gdnserve']}"
         + (f" (git {res['git']['commit']}{', dirty' if res['git']['dirty'] else ''})" if res.get("git") else "")
         + f"; {'quick' if res['quick'] else 'full'} run; backend {res['backend']}; seed {res['seed']}.",
         f"One GDN layer's prefill core (conv + gates + gated delta rule, `gdn_prefill_core`). Shape H={d['H']} "
         f"HV={d['HV']} K={d['K']} V={d['V']} W={d['W']} (D={d['D']}), bf16 activations, fp32 SSM pool, bf16 "
         f"conv pool. `1P512+16C64`: 1 producer of 512 tokens, 16 consumers of 64 tokens from its final state.",
         f"Ceilings measured in this run: copy {c['copy_TBps']:.3g} TB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.3g} "
         f"TFLOP/s.", ""]
    if res.get("fla_note"):
        L += [f"fla: {res['fla_note']}.", ""]
    L += targets_table(res["targets"])
    how = ("µs, median [P10–P90] of CUDA events around the Python call, GPU idle before it (eager: host cost "
           "included)." if cuda else
           "µs, median [P10–P90] of perf_counter wall time of one call. CPU run: tiny shapes, PyTorch path, a smoke "
           "test of the executors and this harness, not a performance figure.")
    L += ["", "## Latency per executor", "", how + " Speedup: serial ÷ fused (medians). max |Δ| vs serial: the "
          "largest absolute difference of any executor's outputs and destination states to serial (0 = "
          "bit-identical).", "",
          "| Workload (producers, consumers) | Tokens | " + " | ".join(f"{m} µs" for m in modes)
          + " | Speedup | max \\|Δ\\| vs serial |", "| --- | --- |" + " --- |" * (len(modes) + 2)]
    for r in res["rows"]:
        L.append(f"| {r['workload']} ({r['producers']}, {r['consumers']}) | {r['tokens']} | "
                 + " | ".join(_t(r, m) for m in modes)
                 + f" | {_f(r.get('speedup'), '.2f', 'x')} | {_f(r.get('max_diff'), '.3g')} |")
    if any("fused" in r["times"] for r in res["rows"]):
        L += ["", "## fused against the floor, a plain prefill and fla", "",
              "graph: GPU µs per call replayed in a CUDA graph. plain: one prefill of a single sequence of the same "
              "token count. fla two-phase: fla 0.6.0, producers packed, index_select/index_copy_, consumers packed "
              "(the reference method), same run. rel-RMS: our fused consumer outputs against fla's. floor: "
              "max(essential bytes / copy rate, FLOPs / bf16 rate) (module docstring); TB/s: essential bytes over "
              "the fused median (eager / graph), % of the copy ceiling.", "",
              "| Workload | fused µs | fused graph µs | plain µs | fused ÷ plain | fla two-phase µs "
              "| fused ÷ fla | rel-RMS vs fla | MB | floor µs | TB/s eager (% copy) | TB/s graph (% copy) "
              "| ×floor graph |",
              "| --- |" + " --- |" * 12]
        for r in res["rows"]:
            tb = lambda tag: (f"{r[f'fused_{tag}_TBps']:.3g} ({r[f'fused_{tag}_pct_copy']:.0f} %)"  # noqa: E731
                              if f"fused_{tag}_TBps" in r else "—")
            rel = r.get("fla_rel_rms", {}).get("o_consumers")
            L.append(f"| {r['workload']} | {_t(r, 'fused')} | {_t(r, 'fused', 'gpu_us')} | {_t(r, 'plain')} | "
                     f"{_f(r.get('fused_over_plain'), '.2f', 'x')} | {_t(r, 'fla two-phase')} | "
                     f"{_f(r.get('fused_over_fla'), '.2f', 'x')} | {_f(rel, '.1e')} | {r['bytes'] / 1e6:.3g} | "
                     f"{r['floor_us']:.3g} | {tb('eager')} | {tb('graph')} | "
                     f"{_f(r.get('fused_graph_x_floor'), '.2f')} |")
    if cuda:
        impls = list(modes) + ["plain"] + (["fla two-phase"] if res["fla"] else [])
        L += ["", "## Every executor as a replayed CUDA graph", "", "GPU µs per call, median [P10–P90].", "",
              "| Workload | " + " | ".join(impls) + " |", "| --- |" + " --- |" * len(impls)]
        for r in res["rows"]:
            L.append(f"| {r['workload']} | " + " | ".join(_t(r, i, "gpu_us") for i in impls) + " |")
    L += ["", "## Host cost", "", "plan: mean perf_counter µs of one `build_step_plan` (validation, layout, one "
          "staged upload), done once per step for all layers. call: mean µs of one `gdn_prefill_core` call, no sync "
          "inside, GPU idle at its start.", "",
          "| Workload | " + " | ".join(f"plan {m}" for m in modes) + " | " + " | ".join(f"call {m}" for m in modes)
          + " |", "| --- |" + " --- |" * (2 * len(modes))]
    for r in res["rows"]:
        L.append(f"| {r['workload']} | " + " | ".join(_f(r["plan_host_us"].get(m), ".1f") for m in modes) + " | "
                 + " | ".join(_f(r["times"].get(m, {}).get("host_us"), ".1f") for m in modes) + " |")
    fla_rows = [r for r in res["rows"] if r.get("fla_rel_rms")]
    if fla_rows:
        L += ["", "## Sanity: fused against fla (rel-RMS)", "", "| Workload | " +
              " | ".join(fla_rows[0]["fla_rel_rms"]) + " |", "| --- |" + " --- |" * len(fla_rows[0]["fla_rel_rms"])]
        for r in fla_rows:
            L.append(f"| {r['workload']} | " + " | ".join(f"{v:.1e}" for v in r["fla_rel_rms"].values()) + " |")
    if res["errors"]:
        L += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in res["errors"]]
    if res.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(L) + "\n"


def write_plot(res: dict[str, Any], path: Path) -> str | None:
    """Latency vs total consumers, one panel per (prefix, suffix) family: one line per executor (+ fla,
    + fused as a graph) over the single-producer workloads; multi-producer workloads as crosses at
    their total consumer count. Returns a note if it could not be drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG plot: matplotlib is not installed (pip install -e '.[bench]')"
    fams: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in res["rows"]:
        fams.setdefault((r["prefix"], r["suffix"]), []).append(r)
    if not fams:
        return "no PNG plot: no rows"
    fig, axes = plt.subplots(1, len(fams), figsize=(6 * len(fams), 4.5), squeeze=False)
    series = [(m, "call_us", "-o") for m in res["modes"]] + [("fla two-phase", "call_us", "-s"),
                                                             ("fused", "gpu_us", "--^")]

    def point(r: dict[str, Any], impl: str, kind: str) -> float | None:
        t = r["times"].get(impl, {})
        ok = kind in t and (kind == "call_us" or t.get("gpu_method") == "cuda_graph")
        return t[kind]["p50"] if ok else None

    for ax, ((lp, ls), rows) in zip(axes[0], sorted(fams.items())):
        single = sorted((r for r in rows if r["producers"] == 1), key=lambda r: r["consumers"])
        multi = [r for r in rows if r["producers"] > 1]
        for impl, kind, style in series:
            label = impl + (" (CUDA graph)" if kind == "gpu_us" else "")
            pts = [(r["consumers"], v) for r in single if (v := point(r, impl, kind)) is not None]
            color = ax.plot(*zip(*pts), style, label=label)[0].get_color() if pts else None
            for r in multi:
                v = point(r, impl, kind)
                if v is not None:
                    ax.scatter([r["consumers"]], [v], marker="x", s=60, color=color,
                               label=None if pts else label)
        for r in multi:
            v = point(r, "fused", "call_us") or point(r, "serial", "call_us")
            if v is not None:
                ax.annotate(r["workload"], (r["consumers"], v), textcoords="offset points", xytext=(4, -12),
                            fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("consumers (total)")
        ax.set_ylabel("µs per GDN layer, median" + (" (eager call)" if res["device_slug"] != "cpu" else ""))
        ax.set_title(f"producers of {lp} tokens, consumers of {ls} tokens" + (" (x: several producers)" if multi
                                                                              else ""), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Grouped prefill, one GDN layer — {res['device']}, {res['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run(device: torch.device, quick: bool, out_dir: Path, use_fla: bool,
        modes: tuple[str, ...] = ALL_MODES) -> dict[str, Any]:
    """Run every workload, write JSON, markdown and (if matplotlib) the PNG; return the result dict."""
    cuda = device.type == "cuda"
    setup = make_setup(cuda, quick)
    notes: list[str] = []
    errors: list[dict[str, str]] = []
    if "serial" not in modes:
        notes.append("serial added to --modes: it is the baseline of the speedup and the correctness column")
    modes = tuple(m for m in ALL_MODES if m in modes or m == "serial")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    if cuda:
        torch.cuda.set_device(device.index if device.index is not None else 0)
    else:
        # One intra-op thread: at these tiny shapes more threads only add OpenMP wake-ups, which made
        # the same call vary from 8 to 700 ms on a 2-core machine.
        notes.append(f"CPU: torch.set_num_threads(1) for the run (was {torch.get_num_threads()})")
    threads = torch.get_num_threads()
    try:
        if not cuda:
            torch.set_num_threads(1)
        return _measure_and_write(device, setup, quick, out_dir, use_fla, modes, notes, errors, seed)
    finally:
        torch.set_num_threads(threads)


def _measure_and_write(device: torch.device, setup: Setup, quick: bool, out_dir: Path, use_fla: bool,
                       modes: tuple[str, ...], notes: list[str], errors: list[dict[str, str]],
                       seed: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    fla = load_fla(use_fla, cuda, notes, missing="no peer column")
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) if cuda else 0
    progress = Progress(len(setup.workloads) * (len(modes) + 4 + (fla is not None)))
    log(f"{device_name(device)}: measuring ceilings; modes {', '.join(modes)}")
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        ceilings = measure_ceilings(device, quick=quick)
        log(f"ceilings: copy {ceilings['copy_TBps']:.3g} TB/s, bf16 {ceilings['bf16_matmul_TFLOPs']:.3g} TFLOP/s")
        for wl in setup.workloads:
            progress.step(f"{wl.label}: building inputs and plans")
            case = None
            try:
                case = build_case(wl, setup, modes, device, fla, l2)
                rows.append(run_case(case, setup, device, ceilings, progress, errors))
            except Exception as e:  # noqa: BLE001
                errors.append({"where": f"{wl.label}", "error": _err(e)})
                log(f"{wl.label} FAILED: {_err(e)}")
                traceback.print_exc(file=sys.stderr)
            del case
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    Progress.clear()
    if fla is not None and not fla.gates_in_kernel:
        notes.append(fla.note)
    for r in rows:
        for impl, t in r["times"].items():
            if t.get("graph_error"):
                notes.append(f"{r['workload']} {impl}: CUDA graph capture failed, graph column empty "
                             f"({t['graph_error']})")
        bad = {m: v for m, v in r.get("max_abs_diff_vs_serial", {}).items() if v != 0}
        if bad:
            notes.append(f"{r['workload']}: executors differ from serial: {bad}")
    notes.append("Reference (vLLM PR 55876, L40S, per GDN forward): 1P+16C serial 12,699 µs, two-phase 1,675 µs "
                 "(7.58x). fla anchor on an H200 (../shared/anchors): 1P512+16C64 serial 23,174 µs, two-phase "
                 "3,037 µs (chunk indices prepared inside each call there, precomputed here).")
    res: dict[str, Any] = {
        "schema": 1, "bench": "grouped_prefill", "device": device_name(device), "device_slug": device_slug(device),
        "date": _dt.date.today().isoformat(), **_versions(), "fla": fla.version if fla else None,
        "fla_note": fla.note if fla else None, "git": _git(), "seed": seed, "quick": quick, "argv": sys.argv,
        "backend": setup.backend, "modes": list(modes), "dims": {**setup.dims.__dict__, "D": setup.dims.D},
        "dtypes": {"act": str(ACT), "ssm_pool": str(STATE), "conv_pool": str(CONV)},
        "iters": setup.iters, "host_iters": setup.host_iters, "ceilings": ceilings, "rows": rows,
        "errors": errors, "notes": notes,
        "targets": evaluate_targets(rows, cuda and setup.dims == QWEN35_GDN),
    }
    if not any("call_us" in t for r in rows for t in r["times"].values()):
        errors.append({"where": "run", "error": "no executor was timed"})
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"grouped_prefill_{res['device_slug']}_{res['date']}"
    res["paths"] = {k: str(stem.with_suffix(f".{k}")) for k in ("json", "md", "png")}
    try:
        why = write_plot(res, Path(res["paths"]["png"]))
    except Exception as e:  # noqa: BLE001 — a plot must not cost the numbers
        why = f"no PNG plot: {_err(e)}"
    if why:
        notes.append(why)
        res["paths"].pop("png")
        log(why)
    Path(res["paths"]["json"]).write_text(jsonfmt.dumps(res))
    md = to_markdown(res)
    Path(res["paths"]["md"]).write_text(md)
    print(md)
    if rows:  # the tables are long: repeat the targets last, where a log's tail shows them
        print("\n".join(["# Summary", ""] + targets_table(res["targets"])))
    log(f"wrote {', '.join(res['paths'].values())}" + (f"; {len(errors)} error(s)" if errors else ""))
    return res


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"--modes: expected a comma-separated subset of {','.join(ALL_MODES)}, got {text!r}")
    return modes


def run_from_args(args: argparse.Namespace) -> int:
    """Entry used by ``gdnserve bench grouped-prefill``: 0 if everything ran, 1 on errors, 2 on bad options."""
    try:
        device = resolve_device(args.device)
        modes = parse_modes(args.modes)
    except (ValueError, RuntimeError) as e:
        print(f"bench grouped-prefill: {e}", file=sys.stderr)
        return 2
    res = run(device, quick=args.quick, out_dir=Path(args.out), use_fla=args.fla, modes=modes)
    return 1 if res["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    from gdnserve.cli import add_bench_grouped_prefill_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_grouped_prefill",
                                     description=__doc__.split("\n")[0])
    add_bench_grouped_prefill_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
