"""Load and soak test of the HTTP server (not a timed test): ``gdnserve serve`` on the embedded model on CPU
in a subprocess, driven over loopback by httpx.

1. **Burst**: ``--requests`` (500) concurrent streaming /v1/completions requests in shared-prefix groups
   (``--group-size`` requests share a prefix ending in ``<|state_checkpoint|>``), all sent at once. Per
   request: TTFT (request sent -> first text chunk) and end-to-end latency; an error is a non-200, an error
   event in the stream, a stream without ``[DONE]`` or a finish reason, or a client exception.
2. **Drain check**: after the burst, ``/metrics`` must show nothing running or waiting and every state slot
   held by a READY checkpoint (``state_pool_slots_used == checkpoints_ready``): no slot leaked.
3. **Soak**: for ``--soak-seconds``, ``--soak-clients`` clients loop over a mix — grouped streaming
   completions, non-streamed completions (n = 2), streamed chat, /v1/score, requests that must get a 4xx
   (limits, bad fields, wrong content type) and streams the client drops after the first chunk. The server's
   RSS (``/proc/PID/status``) is sampled before, during and after; the drain check is repeated at the end.

Writes ``load_cpu.md`` and ``load_cpu.json`` to ``--out`` (default: the user's cache, as ``gdnserve bench``).

    python -m benchmarks.bench_load --out benchmarks/results                   # 500 + 10-minute soak
    python -m benchmarks.bench_load --requests 100 --soak-seconds 30           # a quick look
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gdnserve.cli import DEFAULT_RESULTS
from benchmarks import jsonfmt

MARK = "<|state_checkpoint|>"
MODEL = "gdnserve-embedded"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile of ``xs`` in their own unit, linearly interpolated (numpy's default, as vLLM's serving
    benchmark reports them); None for no values. The one percentile of the HTTP benchmarks (bench_serve_http too)."""
    return float(np.percentile(xs, q)) if xs else None


def wait_healthy(server: Any, log: Path, timeout_s: float, poll_s: float, what: str) -> None:
    """Poll ``server.url``/health until it answers 200; when ``server.proc`` exits or ``timeout_s`` passes,
    ``server.stop()`` and raise ``what`` with the log's tail (this benchmark and bench_serve_http)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{what}:\n" + log.read_text(errors="replace")[-3000:])
        time.sleep(poll_s)


class Server:
    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gdnserve.cli", "serve", "--device", "cpu", "--port", str(self.port),
               "--max-num-seqs", str(args.max_num_seqs), "--num-pages", str(args.num_pages)]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_healthy(self, log, 180, 0.3, "server did not start")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=60).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("" if not s.labels else "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}")
                out[key] = s.value
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def group_prompts(n: int, group_size: int, rng: random.Random, tag: str) -> list[str]:
    prompts = []
    for g in range(-(-n // group_size)):
        prefix = f"[{tag} group {g}] Shared context for ranking: " + " ".join(
            rng.choice(["state", "checkpoint", "delta", "gated", "prefix", "rule", "token"]) for _ in range(24))
        prompts += [f"{prefix}{MARK} candidate {j}: {rng.randrange(10**6)}" for j in range(group_size)]
    return prompts[:n]


async def stream_completion(c: httpx.AsyncClient, prompt: str, max_tokens: int, drop: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    ttft, done, finish, err = None, False, None, None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]["message"]
                    continue
                ch = obj["choices"][0]
                if ttft is None and ch.get("text"):
                    ttft = time.monotonic() - t0
                    if drop:
                        return {"ok": True, "dropped": True}
                finish = ch.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001  an error of the run, counted
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = done and finish is not None and err is None
    return {"ok": ok, "ttft": ttft, "e2e": time.monotonic() - t0, "finish": finish,
            "error": None if ok else (err or f"done={done} finish={finish}")}


async def burst(url: str, n: int, group_size: int, max_tokens: int) -> dict[str, Any]:
    prompts = group_prompts(n, group_size, random.Random(0), "burst")
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(*[stream_completion(c, p, max_tokens) for p in prompts])
        wall = time.monotonic() - t0
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    return {"requests": n, "completed": len(ok), "errors": len(errors), "error_samples": errors[:5], "wall_s": wall,
            "ttft": [r["ttft"] for r in ok if r["ttft"] is not None], "e2e": [r["e2e"] for r in ok]}


BAD = [  # (path, body or raw bytes, content type, expected status)
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "application/json", 400),
    ("/v1/completions", {"prompt": ["p"] * 65}, "application/json", 400),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 300]}, "application/json", 400),
    ("/v1/completions", b'{"prompt": "x"}', "text/plain", 415),
    ("/v1/completions", b"[" * 40 + b"]" * 40, "application/json", 400),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "application/json", 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "application/json", 400),
    ("/v1/score", {"prefix": "a", "candidates": []}, "application/json", 400),
]


async def soak_client(c: httpx.AsyncClient, k: int, until: float, max_tokens: int, stats: dict[str, Any]) -> None:
    rng = random.Random(1000 + k)
    i = 0
    while time.monotonic() < until:
        kind = ("stream", "stream", "json", "chat", "score", "bad", "drop")[i % 7]
        i += 1
        stats["sent"][kind] = stats["sent"].get(kind, 0) + 1
        try:
            if kind in ("stream", "drop"):
                p = group_prompts(4, 4, rng, f"soak{k}-{i % 5}")[rng.randrange(4)]
                r = await stream_completion(c, p, max_tokens, drop=kind == "drop")
                ok, why = r["ok"], r.get("error")
            elif kind == "json":
                r = await c.post("/v1/completions", json={"prompt": f"soak {k} {i} plain prompt", "n": 2,
                                                          "max_tokens": max_tokens, "temperature": 0.7, "seed": i})
                ok, why = r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:200]
            elif kind == "chat":
                body = {"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": f"turn {i} of client {k} <|im_end|>"}],
                        "max_tokens": max_tokens, "stream": True, "temperature": 0}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                ok, why = r.status_code == 200 and lines[-1] == "data: [DONE]", str(lines[-2:])[:200]
            elif kind == "score":
                for _ in range(50):  # 503 server_busy (no free state slot this moment): retry, as it says
                    r = await c.post("/v1/score", json={"prefix": f"Client {k} asks: is it good? Answer:",
                                                        "candidates": [" yes", " no", " maybe"]})
                    if r.status_code != 503:
                        break
                    stats["busy"] = stats.get("busy", 0) + 1
                    await asyncio.sleep(0.2)
                ok, why = r.status_code == 200 and len(r.json()["data"]) == 3, r.text[:200]
            else:
                path, body, ctype, want = BAD[i % len(BAD)]
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await c.post(path, content=raw, headers={"content-type": ctype})
                ok, why = r.status_code == want and "error" in r.json(), f"{path} {r.status_code} {r.text[:120]}"
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            stats["errors"].append(f"{kind}: {why}")
            stats["errors_by_kind"][kind] = stats["errors_by_kind"].get(kind, 0) + 1


async def soak(url: str, pid: int, seconds: float, clients: int, max_tokens: int) -> dict[str, Any]:
    stats: dict[str, Any] = {"sent": {}, "errors": [], "errors_by_kind": {}}
    samples = [(0.0, rss_mib(pid))]
    t0 = time.monotonic()
    until = t0 + seconds

    async def sampler() -> None:
        while time.monotonic() < until:
            await asyncio.sleep(min(30.0, max(until - time.monotonic(), 0.1)))
            samples.append((time.monotonic() - t0, rss_mib(pid)))

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as c:
        await asyncio.gather(sampler(), *[soak_client(c, k, until, max_tokens, stats) for k in range(clients)])
    return {"seconds": time.monotonic() - t0, "clients": clients, "sent": stats["sent"],
            "requests": sum(stats["sent"].values()), "errors": len(stats["errors"]), "score_busy_503": stats.get("busy", 0),
            "errors_by_kind": stats["errors_by_kind"],
            "error_samples": stats["errors"][:5], "rss_samples": samples}


def drained(server: Server, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m.get("gdnserve:num_requests_running", 1) == 0 and m.get("gdnserve:num_requests_waiting", 1) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def pool_row(m: dict[str, float]) -> dict[str, Any]:
    used, ready = m.get("gdnserve:state_pool_slots_used"), m.get("gdnserve:checkpoints_ready")
    return {"running": m.get("gdnserve:num_requests_running"), "waiting": m.get("gdnserve:num_requests_waiting"),
            "state_slots_used": used, "checkpoints_ready": ready, "state_slots_total": m.get("gdnserve:state_pool_slots_total"),
            "kv_pages_used": m.get("gdnserve:kv_cache_pages_used"), "kv_pages_total": m.get("gdnserve:kv_cache_pages_total"),
            "preemptions": m.get("gdnserve:num_preemptions_total"), "checkpoint_hits": m.get("gdnserve:checkpoint_hits_total"),
            "only_ready_checkpoints": used == ready and m.get("gdnserve:num_requests_running") == 0}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "?"
    except OSError:
        return "?"


def markdown(res: dict[str, Any]) -> str:
    b, s, a = res["burst"], res.get("soak"), res["args"]
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f} ms"  # noqa: E731
    p0, p1 = res["pool_after_burst"], res.get("pool_after_soak")
    lines = [
        "# HTTP load test (`benchmarks/bench_load.py`)", "",
        f"`gdnserve serve --device cpu --max-num-seqs {a['max_num_seqs']} --num-pages {a['num_pages']}` (embedded model) "
        f"on loopback, commit {res['commit']}, {res['date']}, {os.cpu_count()} CPU cores (shared), torch "
        f"{res['torch']}. Command: `{res['command']}`.", "",
        "## Burst: concurrent streaming requests in shared-prefix groups", "",
        "| requests | groups x size | max_tokens | completed | errors | wall | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {b['requests']} | {-(-b['requests'] // a['group_size'])} x {a['group_size']} | {a['max_tokens']} | "
        f"{b['completed']}/{b['requests']} | {b['errors']} | {b['wall_s']:.1f} s | {ms(pct(b['ttft'], 50))} | "
        f"{ms(pct(b['ttft'], 99))} | {ms(pct(b['e2e'], 50))} | {ms(pct(b['e2e'], 99))} |", "",
        "## Pools after drain (must hold READY checkpoints only)", "",
        "| after | running | waiting | state slots used | READY checkpoints | KV pages used | preemptions | "
        "checkpoint hits | only READY |", "|---|---|---|---|---|---|---|---|---|"]
    for name, p in (("burst", p0), ("soak", p1)):
        if p:
            lines.append(f"| {name} | {p['running']:.0f} | {p['waiting']:.0f} | {p['state_slots_used']:.0f}/"
                         f"{p['state_slots_total']:.0f} | {p['checkpoints_ready']:.0f} | {p['kv_pages_used']:.0f}/"
                         f"{p['kv_pages_total']:.0f} | {p['preemptions']:.0f} | {p['checkpoint_hits']:.0f} | "
                         f"{'yes' if p['only_ready_checkpoints'] else 'NO'} |")
    if s:
        r = s["rss_samples"]
        lines += ["", "## Soak", "",
                  "| duration | clients | requests | errors | score 503s retried | RSS before | RSS after | RSS max |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {s['seconds']:.0f} s | {s['clients']} | {s['requests']} | {s['errors']} | {s['score_busy_503']} | "
                  f"{r[0][1]:.0f} MiB | "
                  f"{r[-1][1]:.0f} MiB | {max(x for _, x in r):.0f} MiB |", "",
                  "Mix per client, in turn: " + ", ".join(f"{k} {v}" for k, v in sorted(s["sent"].items())) +
                  " (stream: grouped streaming completions; json: n = 2 non-streamed; chat: streamed, with a "
                  "special-token string in the user text; score: 3 candidates; bad: must get its 4xx; drop: "
                  "the client disconnects after the first chunk).", "",
                  "RSS samples (s: MiB): " + ", ".join(f"{t:.0f}: {x:.0f}" for t, x in r)]
        if s["errors_by_kind"]:
            lines += ["", "Soak errors by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_kind"].items()))
                      + ". A score request is retried on 503 `server_busy` (Retry-After) up to 50 times, 0.2 s apart; "
                      "it counts as an error when it is still refused after that."]
        if s["error_samples"]:
            lines += ["", "Soak error samples: " + "; ".join(s["error_samples"])]
    if b["error_samples"]:
        lines += ["", "Burst error samples: " + "; ".join(b["error_samples"])]
    lines += ["", f"Server RSS: {res['rss_start']:.0f} MiB after start-up and warm-up, {res['rss_after_burst']:.0f} MiB "
              f"after the burst."]
    if "loadavg_before" in res:
        lines += ["", "Machine load average (1, 5, 15 min) before / after: "
                  + " / ".join(", ".join(f"{x:.1f}" for x in res[k]) for k in ("loadavg_before", "loadavg_after"))
                  + " (the cores are shared: latencies are of this machine at that moment, not a performance figure)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="concurrent streaming requests in the burst (default 500)")
    ap.add_argument("--group-size", type=int, default=10, help="requests sharing one prefix (default 10)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default 8)")
    ap.add_argument("--soak-seconds", type=float, default=600.0, help="soak duration (default 600; 0 = no soak)")
    ap.add_argument("--soak-clients", type=int, default=32, help="concurrent soak clients (default 32)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help=f"output folder (default {DEFAULT_RESULTS})")
    args = ap.parse_args(argv)
    import torch
    commit, load_before = git_commit(), os.getloadavg()  # the code under test; other work on the machine
    args.out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.gettempdir()) / f"gdnserve_bench_load_{os.getpid()}.log"  # the server's log: not a result
    print(f"server log: {log}", flush=True)
    server = Server(args, log)
    try:
        asyncio.run(burst(server.url, 20, 10, 2))  # warm-up
        rss_start = rss_mib(server.proc.pid)
        print(f"server up (RSS {rss_start:.0f} MiB); burst of {args.requests}", flush=True)
        b = asyncio.run(burst(server.url, args.requests, args.group_size, args.max_tokens))
        print(f"burst: {b['completed']}/{b['requests']} in {b['wall_s']:.1f} s, {b['errors']} errors", flush=True)
        pool_burst = pool_row(drained(server))
        rss_burst = rss_mib(server.proc.pid)
        res: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "commit": commit,
                               "loadavg_before": load_before,
                               "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                               "command": "python -m benchmarks.bench_load " + " ".join(argv or sys.argv[1:]),
                               "burst": b, "pool_after_burst": pool_burst, "rss_start": rss_start,
                               "rss_after_burst": rss_burst}
        if args.soak_seconds > 0:
            print(f"soak: {args.soak_seconds:.0f} s with {args.soak_clients} clients", flush=True)
            res["soak"] = asyncio.run(soak(server.url, server.proc.pid, args.soak_seconds, args.soak_clients,
                                           args.max_tokens))
            res["pool_after_soak"] = pool_row(drained(server))
            res["soak"]["rss_samples"].append((res["soak"]["seconds"] + 1, rss_mib(server.proc.pid)))
            print(f"soak: {res['soak']['requests']} requests, {res['soak']['errors']} errors", flush=True)
    finally:
        server.stop()
    res["loadavg_after"] = os.getloadavg()
    (args.out / "load_cpu.json").write_text(jsonfmt.dumps(res))
    md = markdown(res)
    (args.out / "load_cpu.md").write_text(md)
    print(md)
    bad = b["errors"] or not pool_burst["only_ready_checkpoints"] or (
        "soak" in res and (res["soak"]["errors"] or not res["pool_after_soak"]["only_ready_checkpoints"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
