"""Timing for the op benchmarks, and the device's measured ceilings.

``time_call`` gives three numbers per op, because they answer different questions:

* **call** — CUDA events recorded just before and just after the Python call, with the GPU idle
  at the start (synchronised before each call, outside the timed region). Whenever the host is
  slower than the kernels this includes the host cost of enqueueing: what one eager call costs.
* **gpu** — the same work (``n`` calls back to back, rotating inputs) captured once in a
  ``torch.cuda.CUDAGraph`` and replayed; events around each replay, divided by ``n``. No Python
  runs in between: what the kernels cost, launch gaps inside the graph included. If capture fails
  (a host sync, or anything else a graph cannot hold) the fallback is events around ``n``
  back-to-back eager calls divided by ``n``, labelled ``batched_events``: an upper bound, host-bound
  when the kernels are small.
* **host** — ``perf_counter`` around one call without any synchronisation inside the timed region,
  the GPU **idle** at the start of each call (synchronised before it, outside the timed region), so
  launches never wait for queue space; mean over many calls. A host sync inside the call (``.item()``,
  ``.tolist()``, boolean indexing) shows up here as the GPU time it waits for.

Warm-up calls run first (at least one per input set), so Triton compilation and autotuning never
land in the numbers. When the inputs fit in L2 (60 MB on an H200) repeated calls on one buffer
would time the cache: pass several input sets as ``rotate`` and each call takes the next one.

On CPU all three are ``perf_counter`` wall times of one call (``gpu`` = ``call``, method ``cpu_wall``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

US_PER_MS = 1000.0


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """{p10, p50, p90} by nearest rank of the sorted values."""
    v = sorted(values)
    if not v:
        return {"p10": float("nan"), "p50": float("nan"), "p90": float("nan")}
    pick = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9)}


def _resolve(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _caller(fn: Callable[..., Any], rotate: Sequence[Any] | None) -> tuple[Callable[[int], Any], int]:
    if rotate is None:
        return (lambda i: fn()), 1
    inputs = list(rotate)
    if not inputs:
        raise ValueError("rotate: need at least one input set")
    return (lambda i: fn(inputs[i % len(inputs)])), len(inputs)


def _time_cpu(call: Callable[[int], Any], n_sets: int, iters: int, warmup: int) -> dict[str, Any]:
    for i in range(max(warmup, n_sets)):
        call(i)
    ts = []
    for i in range(iters):
        t0 = time.perf_counter()
        call(i)
        ts.append((time.perf_counter() - t0) * 1e6)
    p = percentiles(ts)
    return {"call_us": p, "gpu_us": dict(p), "gpu_method": "cpu_wall", "graph_calls": 1,
            "host_us": sum(ts) / len(ts), "iters": iters, "n_inputs": n_sets}


def _events_around(run: Callable[[], Any]) -> float:
    """Microseconds between events recorded around run(), the GPU idle at the start."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * US_PER_MS


def _graph_time(call: Callable[[int], Any], n: int, replays: int) -> tuple[list[float] | None, str | None]:
    """Per-call GPU times from a graph of n back-to-back calls, or (None, why) if capture fails."""
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # PyTorch's recipe: one eager pass on a side stream first
            for i in range(n):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(i)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 — any capture failure means "not capturable": fall back
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}"[:300]
    try:
        return [_events_around(graph.replay) / n for _ in range(replays)], None
    finally:
        del graph


def _batched_time(call: Callable[[int], Any], n: int, replays: int) -> list[float]:
    def batch() -> None:
        for i in range(n):
            call(i)
    return [_events_around(batch) / n for _ in range(replays)]


def host_time(fn: Callable[..., Any], *, iters: int, rotate: Sequence[Any] | None = None,
              device: torch.device | str | None = None, warmup: int = 1) -> float:
    """Mean µs of perf_counter around one call, GPU idle at each call's start (see module doc),
    after ``warmup`` calls per input set."""
    call, n_sets = _caller(fn, rotate)
    cuda = _resolve(device).type == "cuda"
    for i in range(warmup * n_sets):
        call(i)
    total = 0.0
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(i)
        total += time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return total / iters * 1e6


def time_call(fn: Callable[..., Any], *, iters: int, warmup: int, rotate: Sequence[Any] | None = None,
              host_iters: int | None = None, graph: bool = True, graph_target_us: float = 1000.0,
              max_graph_calls: int = 64, device: torch.device | str | None = None) -> dict[str, Any]:
    """Time ``fn()`` (or ``fn(rotate[i % len(rotate)])``). Returns
    ``{call_us, gpu_us: {p10, p50, p90}, gpu_method, graph_calls, host_us, iters, n_inputs}``, µs.

    The graph holds ``n`` calls, ``n`` chosen so that one replay lasts about ``graph_target_us``
    (from the median call time), rounded up to a multiple of the number of input sets."""
    call, n_sets = _caller(fn, rotate)
    if _resolve(device).type != "cuda":
        return _time_cpu(call, n_sets, iters, warmup)
    for i in range(max(warmup, n_sets)):
        call(i)
    torch.cuda.synchronize()
    call_us = [_events_around(lambda i=i: call(i)) for i in range(iters)]
    p_call = percentiles(call_us)

    n = max(1, min(max_graph_calls, round(graph_target_us / max(p_call["p50"], 1e-3))))
    n = max(n_sets, -(-n // n_sets) * n_sets)
    gpu_us, why = _graph_time(call, n, iters) if graph else (None, "graph=False")
    method = "cuda_graph"
    if gpu_us is None:
        gpu_us, method = _batched_time(call, n, iters), "batched_events"
    host = host_time(fn, iters=host_iters or 4 * iters, rotate=rotate, device="cuda", warmup=0)
    return {"call_us": p_call, "gpu_us": percentiles(gpu_us), "gpu_method": method, "graph_calls": n,
            "graph_error": why, "host_us": host, "iters": iters, "n_inputs": n_sets}


def measure_ceilings(device: torch.device | str | None = None, quick: bool = False) -> dict[str, Any]:
    """Measured ceilings to hold achieved numbers against (not datasheet figures).

    copy_TBps: device-to-device copy of 1 GiB (64 MiB on CPU), bytes read + written.
    bf16_matmul_TFLOPs: N^3 product of random bf16 matrices, N = 8192 (1024 on CPU), 2 N^3 FLOP.
    fp32_matmul_TFLOPs: the same in fp32 with TF32 off (IEEE fp32 FMA on the CUDA cores)."""
    dev = _resolve(device)
    cuda = dev.type == "cuda"
    n_bytes = (1 << 30) if cuda else (1 << 26)
    n_mm = 8192 if cuda else 1024
    iters, warmup = (10, 2) if (quick or not cuda) else (20, 3)

    def gpu_p50(fn: Callable[[], Any], graph: bool = True) -> tuple[float, str]:
        r = time_call(fn, iters=iters, warmup=warmup, host_iters=2, graph_target_us=0.0, graph=graph, device=dev)
        return (r["gpu_us"]["p50"], r["gpu_method"]) if graph else (r["call_us"]["p50"], "events")

    def copy_time() -> tuple[float, str]:
        # fp32 elements and plain events: the first H200 run timed a uint8 copy inside a CUDA graph and got
        # 2.7 TB/s, below what our decode kernel itself moved (3.9 TB/s); the anchor's events give 4.1 TB/s.
        src = torch.randn(n_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        return gpu_p50(lambda: dst.copy_(src), graph=not cuda)

    def matmul_time(dtype: torch.dtype) -> float:
        a = torch.randn(n_mm, n_mm, device=dev, dtype=dtype)
        b = torch.randn(n_mm, n_mm, device=dev, dtype=dtype)
        c = torch.empty(n_mm, n_mm, device=dev, dtype=dtype)
        return gpu_p50(lambda: torch.matmul(a, b, out=c))[0]

    t_copy, method = copy_time()
    out: dict[str, Any] = {"copy_TBps": 2 * n_bytes / (t_copy * 1e-6) / 1e12, "copy_bytes": n_bytes,
                           "matmul_n": n_mm, "method": method}
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")   # fp32 row: IEEE fp32, no TF32
    try:
        for name, dtype in (("bf16_matmul_TFLOPs", torch.bfloat16), ("fp32_matmul_TFLOPs", torch.float32)):
            out[name] = 2 * n_mm ** 3 / (matmul_time(dtype) * 1e-6) / 1e12
    finally:
        torch.set_float32_matmul_precision(prev)
    if cuda:
        torch.cuda.empty_cache()
    return out
