"""Serving benchmark over HTTP: our own load generator (not vLLM's script), with the metric definitions of vLLM's
``benchmarks/benchmark_serving.py`` / ``vllm bench serve``, driving a real ``gdnserve serve`` process through the
OpenAI streaming protocol (httpx, asyncio: a semaphore keeps C requests in flight until N have run).

Server: started here (``gdnserve serve`` on the embedded model or ``--model DIR``; ``--random full|bench|tiny``:
``benchmarks/serve_random.py``, the random-weight Qwen3.5-35B-A3B shapes, ``--fp8`` for block-FP8 weights), with
``--device``, ``--dtype``, ``--gpu-memory-utilization``, ``--memory-budget-gb``, ``--max-num-seqs``,
``--max-model-len``, ``--num-pages``, ``--num-slots`` and ``--serve-args "..."`` passed through; its banner (the
memory plan) goes into the JSON. Or ``--url`` of a running server.

Workloads, each at every concurrency level of ``--concurrency`` (default 1,16,64,256,max; max = the server's
banner "capacity: N concurrent requests", else --max-num-seqs):

- **random**: the peers' workload: I random token ids in, O tokens out (``ignore_eos``), N = 4 x C requests.
- **prefix**: the RFC shared-prefix workload: groups of one P-token prefix and G candidates of 16-32 tokens, each
  prompt ``prefix <|state_checkpoint|> candidate`` (text), O tokens out; the group's requests are sent together.
- **chat**: C conversations of T turns; turn t + 1's prompt is turn t's prompt + its answer + new user text, so it
  resumes from turn t's automatic checkpoint (text; the random model's tokenizer round-trips its answers exactly,
  the embedded byte tokenizer does not, so its chat rows hit less).

Metrics per row (vLLM's definitions): TTFT = request sent -> first chunk carrying text; TPOT = (end-to-end - TTFT)
/ (output tokens - 1) per request (output tokens from the stream's ``usage``); ITL = the gaps between successive
text chunks, a chunk of k tokens counting k gaps of 1/k each (k = its characters with a one-character-per-token
tokenizer, ``--random``; else 1, one chunk per engine step); p50 and p99 over requests (TTFT, TPOT) or gaps
(ITL); total and output tokens/s and requests/s over the level's wall time; errors (non-200, an error event, no
``[DONE]``, a client exception); checkpoint hit rate (requests whose ``gdnserve`` provenance has hit_length > 0) and
the share of prompt tokens served from checkpoints; the client's CPU share (near 1: the client limits the row);
``ceiling_tok_s``: the bare decode step's tokens/s at batch C from a ``bench model`` JSON (``--model-json``).

Speculative decoding (issue 27 item 3): ``--spec-k K --spec-draft mtp|ngram`` go to the server; with ``--random``,
``--spec-oracle RATE`` makes its drafts an oracle's (``serve_random.py``: the model's greedy continuation is a
known chain, and the drafter's proposals become it, RATE x K accepted per step on average; the MTP head still runs).
Rows carry ``spec`` (e.g. ``mtp k=3 oracle 0.6``, ``none``) and ``spec_acceptance`` (accepted / drafted tokens over
the level, from the server's ``/metrics``). The peers' MTP numbers: ``--workloads random --concurrency 1,16
--spec-k 3 --spec-draft mtp --spec-oracle 1.0`` (and 0.6), with ``--tag`` per rate.

Writes ``serve_http_<tag>.json`` and ``.md`` to ``--out`` after every row (tag: the device slug, + ``_fp8``).

    python -m benchmarks.bench_serve_http --random full --device cuda --out benchmarks/results
    python -m benchmarks.bench_serve_http --quick          # CPU smoke: embedded model, tiny I/O, C = 1, 4
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import jsonfmt
from benchmarks.bench_load import free_port, pct, wait_healthy
from gdnserve.cli import DEFAULT_RESULTS

MARK = "<|state_checkpoint|>"
WORKLOADS = ("random", "prefix", "chat")
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"   # one token per character for the byte and char tokenizers


# ---- workloads ------------------------------------------------------------------------------------------------

@dataclass
class Sizes:
    input_len: int = 1024        # random: I
    output_len: int = 128        # random: O
    prefix_len: int = 600        # prefix: P
    group: int = 10              # prefix: G candidates per prefix
    cand_len: tuple[int, int] = (16, 32)
    prefix_output: int = 16
    chat_system: int = 512       # chat: the first turn's shared context
    chat_user: int = 64
    chat_answer: int = 128
    chat_turns: int = 4
    per_level: int = 4           # random / prefix: N = per_level x C requests (at least min_requests)
    min_requests: int = 16
    num_requests: int | None = None    # a fixed N instead


QUICK = Sizes(input_len=8, output_len=4, prefix_len=24, group=3, cand_len=(3, 5), prefix_output=4, chat_system=16,
              chat_user=4, chat_answer=4, chat_turns=2, per_level=2, min_requests=4)


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def random_requests(rng: random.Random, n: int, s: Sizes, vocab: int) -> list[dict[str, Any]]:
    return [{"prompt": [rng.randrange(vocab) for _ in range(s.input_len)], "max_tokens": s.output_len}
            for _ in range(n)]


def prefix_requests(rng: random.Random, n: int, s: Sizes) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while len(out) < n:
        prefix = text(rng, s.prefix_len)
        out += [{"prompt": f"{prefix}{MARK}{text(rng, rng.randint(*s.cand_len))}", "max_tokens": s.prefix_output}
                for _ in range(s.group)]
    return out[:n]


# ---- one request ------------------------------------------------------------------------------------------------

@dataclass
class Record:
    ok: bool = False
    error: str | None = None
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)    # (time since sent, tokens) per text chunk
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    hit_length: int = 0
    body: dict[str, Any] = field(default_factory=dict)      # what was sent (the solo check replays it)
    tokens: list[str] = field(default_factory=list)         # with "logprobs" in the body: each token's text
    top: list[dict[str, float]] = field(default_factory=list)   # ... and its top logprobs


async def stream(client: httpx.AsyncClient, model: str, body: dict[str, Any], chars: bool) -> Record:
    """One streamed /v1/completions request (``ignore_eos``, greedy, usage at the end)."""
    rec = Record(sent=time.perf_counter(), body=body)
    req = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}, **body}
    done, finish = False, None
    try:
        async with client.stream("POST", "/v1/completions", json=req) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                now, obj = time.perf_counter() - rec.sent, json.loads(line[6:])
                if "error" in obj:
                    rec.error = str(obj["error"].get("message"))[:200]
                    continue
                if obj.get("usage"):
                    rec.prompt_tokens, rec.output_tokens = obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"]
                for p in obj.get("gdnserve", {}).get("prompts", []):
                    rec.hit_length = p.get("hit_length") or 0
                for ch in obj.get("choices", []):
                    lp = ch.get("logprobs") or {}
                    rec.tokens += lp.get("tokens") or []
                    rec.top += [t or {} for t in lp.get("top_logprobs") or []]
                    if ch.get("text"):
                        rec.chunks.append((now, len(ch["text"]) if chars else 1))
                        rec.text += ch["text"]
                    finish = ch.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001  counted as the row's error
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec.e2e = time.perf_counter() - rec.sent
    rec.ttft = rec.chunks[0][0] if rec.chunks else None
    rec.ok = done and finish is not None and rec.error is None and rec.ttft is not None
    if not rec.ok and rec.error is None:
        rec.error = f"done={done} finish={finish} chunks={len(rec.chunks)}"
    return rec


# ---- one level --------------------------------------------------------------------------------------------------

async def run_level(url: str, model: str, workload: str, C: int, s: Sizes, vocab: int, chars: bool,
                    seed: int) -> tuple[list[Record], float, float]:
    """The level's records, wall seconds and client CPU seconds."""
    rng = random.Random(f"{seed}-{workload}-{C}")
    limits = httpx.Limits(max_connections=C + 8, max_keepalive_connections=C + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0, c0 = time.perf_counter(), time.process_time()
        if workload == "chat":
            recs = [r for conv in await asyncio.gather(*[conversation(client, model, rng, s, chars) for _ in range(C)])
                    for r in conv]
        else:
            n = s.num_requests or max(s.min_requests, s.per_level * C)
            bodies = random_requests(rng, n, s, vocab) if workload == "random" else prefix_requests(rng, n, s)
            gate = asyncio.Semaphore(C)

            async def one(body: dict[str, Any]) -> Record:
                async with gate:
                    return await stream(client, model, body, chars)
            recs = list(await asyncio.gather(*[one(b) for b in bodies]))
        return recs, time.perf_counter() - t0, time.process_time() - c0


async def conversation(client: httpx.AsyncClient, model: str, rng: random.Random, s: Sizes, chars: bool) -> list[Record]:
    prompt, recs = text(rng, s.chat_system), []
    for _ in range(s.chat_turns):
        prompt += f"\nuser: {text(rng, s.chat_user)}\nassistant:"
        rec = await stream(client, model, {"prompt": prompt, "max_tokens": s.chat_answer}, chars)
        recs.append(rec)
        if not rec.ok:
            break
        prompt += rec.text        # the answer as generated: the next turn starts from its automatic checkpoint
    return recs


# ---- after the levels: equal to the request alone, nothing leaked ---------------------------------------------

NEAR_TIE = 0.05     # nats: a batched token this close to the solo run's best is a rounding flip, not a wrong answer
SOLO_TOP = 5


def near_tie_gap(alone: Record, batched_text: str, d: int) -> float | None:
    """At the first differing character ``d``: the solo run's logprob of its own token minus that of the batched
    run's token at the same position (>= 0; 0 = an exact tie), or None when the batched token is not among the
    solo run's top ``SOLO_TOP`` there (or the solo run sent no logprobs)."""
    start = 0
    for j, tok in enumerate(alone.tokens):
        if start + len(tok) > d or j == len(alone.tokens) - 1:
            break
        start += len(tok)
    else:
        return None
    for i in ((j, j - 1) if d == start and j > 0 else (j,)):      # a batched token that extends the solo one
        if i != j:                                                # ends where solo token j starts: position j-1
            start -= len(alone.tokens[i])
        if i >= len(alone.top) or alone.tokens[i] not in alone.top[i]:
            continue
        rest = batched_text[start:]
        cands = [t for t in alone.top[i] if t and t != alone.tokens[i] and rest.startswith(t)]
        if cands:
            return round(alone.top[i][alone.tokens[i]] - alone.top[i][max(cands, key=len)], 4)
    return None


async def solo_check(url: str, model: str, recs: list[Record], chars: bool) -> dict[str, Any]:
    """Replay each of ``recs`` (ok records of the most concurrent level) alone and compare the greedy texts
    (issue 27: every response equal to the same request run alone). The replay asks for the top ``SOLO_TOP``
    logprobs, so an unequal pair is classified: ``first_diff`` the first differing character (batched vs alone),
    ``gaps`` the solo run's logprob margin of its token over the batched run's token there (None: the batched
    token is not in the solo run's top ``SOLO_TOP``: not a near-tie), ``near_ties`` how many margins are
    <= ``NEAR_TIE`` (a bf16 rounding flip between batch shapes; the texts then diverge legitimately)."""
    out: dict[str, Any] = {"checked": 0, "equal": 0, "first_diff": [], "gaps": [], "near_ties": 0}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0)) as client:
        for r in recs:
            alone = await stream(client, model, r.body, chars)        # as sent (logprobs would turn drafts off)
            if not alone.ok:
                out.setdefault("errors", []).append(alone.error)
                continue
            out["checked"] += 1
            if alone.text == r.text:
                out["equal"] += 1
                continue
            tops = await stream(client, model, {**r.body, "logprobs": SOLO_TOP}, chars)
            if tops.ok and tops.text == alone.text:     # the margins of the same solo text
                alone = tops
            d = next((i for i, (x, y) in enumerate(zip(alone.text, r.text)) if x != y),
                     min(len(alone.text), len(r.text)))
            gap = near_tie_gap(alone, r.text, d)
            out["first_diff"].append(d)
            out["gaps"].append(gap)
            out["near_ties"] += gap is not None and gap <= NEAR_TIE
    return out


def leak_check(url: str) -> dict[str, Any]:
    """After the run, from /metrics: no request running or waiting, and every state slot in use held by a READY
    checkpoint (a slot beyond them is a leaked request's)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    got = {k: metric(text, n) for k, n in (("running", "num_requests_running"), ("waiting", "num_requests_waiting"),
                                    ("slots_used", "state_pool_slots_used"), ("checkpoints", "checkpoints_ready"))}
    got["ok"] = None not in got.values() and got["running"] == 0 and got["waiting"] == 0 \
        and got["slots_used"] == got["checkpoints"]
    return got


def pct_ms(xs: list[float], q: float) -> float | None:
    """bench_load's percentile of seconds, in ms to 0.01."""
    p = pct(xs, q)
    return None if p is None else round(p * 1e3, 2)


def summarize(workload: str, fmt: str, C: int, recs: list[Record], wall: float, cpu: float,
              ceiling: float | None, spec: str = "none", acceptance: float | None = None) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl: list[float] = []
    for r in ok:
        for (t_prev, _), (t, k) in zip(r.chunks, r.chunks[1:]):
            itl += [(t - t_prev) / k] * k
    prompt, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    hits = [r for r in ok if r.hit_length > 0]
    out_s = out / wall if wall > 0 else 0.0
    return {"workload": workload, "format": fmt, "spec": spec, "spec_acceptance": acceptance, "concurrency": C,
            "requests": len(recs), "completed": len(ok),
            "errors": len(recs) - len(ok), "error_samples": [r.error for r in recs if not r.ok][:3],
            "duration_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
            "total_tok_s": round((prompt + out) / wall, 1) if wall > 0 else None, "output_tok_s": round(out_s, 1),
            "prompt_tokens": prompt, "output_tokens": out,
            "ttft_p50_ms": pct_ms([r.ttft for r in ok], 50), "ttft_p99_ms": pct_ms([r.ttft for r in ok], 99),
            "tpot_p50_ms": pct_ms(tpot, 50), "tpot_p99_ms": pct_ms(tpot, 99),
            "itl_p50_ms": pct_ms(itl, 50), "itl_p99_ms": pct_ms(itl, 99),
            "checkpoint_hit_rate": round(len(hits) / len(ok), 3) if ok else None,
            "hit_token_share": round(sum(r.hit_length for r in ok) / prompt, 3) if prompt else None,
            "client_cpu_share": round(cpu / wall, 2) if wall > 0 else None,
            "ceiling_tok_s": ceiling, "pct_of_ceiling": round(100 * out_s / ceiling, 1) if ceiling else None}


# ---- the server -------------------------------------------------------------------------------------------------

class Server:
    """``gdnserve serve`` (or ``benchmarks.serve_random``) in a subprocess, its output in a log file."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        mod = ["-m", "benchmarks.serve_random", "--shape", args.random] if args.random else \
            ["-m", "gdnserve.cli", "serve"]
        flags = ["--port", str(port), "--device", args.device]
        for name in ("model", "dtype", "gpu_memory_utilization", "memory_budget_gb", "max_num_seqs", "max_model_len",
                     "num_pages", "num_slots", "spec_k", "spec_draft", "spec_oracle"):
            v = getattr(args, name)
            if v is not None:
                flags += [f"--{name.replace('_', '-')}", str(v)]
        flags += ["--fp8"] * bool(args.fp8) + args.serve_args.split()
        self.command = [sys.executable, *mod, *flags]
        self.log_path, self.log = log, open(log, "w")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=Path(__file__).parents[1])
        wait_healthy(self, log, args.startup_timeout, 0.5, f"server did not start ({' '.join(self.command)})")

    def banner(self) -> list[str]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [x for x in lines if x.startswith(("gdnserve:", "  "))][:12]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def server_facts(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def spec_counts(url: str) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) so far from the server's /metrics; None where it has no such counters."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    draft, accepted = (metric(text, f"spec_decode_num_{k}_tokens") for k in ("draft", "accepted"))
    return (draft, accepted) if draft is not None and accepted is not None else None


def metric(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``gdnserve:NAME`` (a counter's ``_total`` too) in /metrics ``text``."""
    m = re.search(rf"^gdnserve:{name}(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def spec_label(args: argparse.Namespace) -> str:
    if not args.spec_k:
        return "none"
    oracle = f" oracle {args.spec_oracle:g}" if args.spec_oracle is not None else ""
    return f"{args.spec_draft or 'ngram'} k={args.spec_k}{oracle}"


def max_concurrency(banner: list[str], fallback: int) -> int:
    m = next((re.search(r"capacity: (\d+) concurrent requests", x) for x in banner if "capacity:" in x), None)
    return int(m.group(1)) if m else fallback


def vocab_of(args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    if args.random:
        from benchmarks.serve_random import random_hf_config
        return random_hf_config(args.random)["vocab_size"]
    if args.model:
        return json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size", 256)
    return 256        # the embedded model's bytes (and a safe floor for --url)


def ceiling_for(model_json: dict[str, Any] | None, fmt: str, C: int) -> float | None:
    """The bare decode step's tokens/s at batch C (gdnserve's row of the format) from a bench_model JSON, or from
    a bench_fp8 JSON (its ``model`` list: the full-size model per format, ``decode[C].tok_s``)."""
    for r in (model_json or {}).get("rows", []):
        if (r.get("kind") == "decode" and r.get("impl") == "gdnserve" and r.get("shape") == f"B={C}"
                and r.get("format", "bf16") == fmt):
            return r.get("tokens_per_s")
    for m in (model_json or {}).get("model", []):
        if m.get("format") == fmt and str(C) in (m.get("decode") or {}):
            tok = m["decode"][str(C)].get("tok_s")
            return None if tok is None else round(tok)
    return None


# ---- report -----------------------------------------------------------------------------------------------------

COLUMNS = ("workload", "format", "spec (acceptance)", "C", "requests", "errors", "req/s", "total tok/s", "output tok/s",
           "TTFT p50/p99 ms",
           "TPOT p50/p99 ms", "ITL p50/p99 ms", "hit rate", "hit tokens", "ceiling tok/s (%)", "client CPU")


def markdown(res: dict[str, Any]) -> str:
    f = lambda x: "—" if x is None else f"{x:g}" if isinstance(x, (int, float)) else str(x)  # noqa: E731
    L = [f"# Serving over HTTP (`benchmarks/bench_serve_http.py`) — {res['device']}, {res['date']}", "",
         f"Server: `{res['server']}`; git {res['git']}; {'quick' if res['quick'] else 'full'} run, "
         f"{res.get('elapsed_s', 0):.0f} s" + ("" if res["complete"] else " — **partial**") + ".", ""]
    if res.get("banner"):
        L += ["```", *res["banner"], "```", ""]
    L += [f"Sizes: {res['sizes']}. Definitions: docs/benchmarks.md § HTTP serving.", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in res["rows"]:
        ceil = "—" if r["ceiling_tok_s"] is None else f"{r['ceiling_tok_s']:g} ({f(r['pct_of_ceiling'])} %)"
        spec = r.get("spec", "none") + ("" if r.get("spec_acceptance") is None else f" ({r['spec_acceptance']:g})")
        L.append("| " + " | ".join([r["workload"], r["format"], spec, str(r["concurrency"]), str(r["requests"]),
                                    str(r["errors"]), f(r["requests_per_s"]), f(r["total_tok_s"]), f(r["output_tok_s"]),
                                    f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])}",
                                    f"{f(r['tpot_p50_ms'])} / {f(r['tpot_p99_ms'])}",
                                    f"{f(r['itl_p50_ms'])} / {f(r['itl_p99_ms'])}", f(r["checkpoint_hit_rate"]),
                                    f(r["hit_token_share"]), ceil, f(r["client_cpu_share"])]) + " |")
    if res.get("solo"):
        L += ["", "Equal to the request alone (greedy; requests of the most concurrent level replayed one at a time): "
              + "; ".join(f"{w} {v['equal']}/{v['checked']}" + (
                  f" (first differing character {v['first_diff']}; the solo run's logprob margin there "
                  f"{v.get('gaps')}, {v.get('near_ties', 0)} of {len(v['first_diff'])} near-ties <= {NEAR_TIE} nats)"
                  if v["first_diff"] else "") for w, v in res["solo"].items()) + "."]
    if res.get("leaks"):
        k = res["leaks"]
        L += ["", f"After the run: {k['running']:g} running, {k['waiting']:g} waiting, {k['slots_used']:g} state slots "
              f"in use for {k['checkpoints']:g} READY checkpoints: " + ("nothing leaked." if k["ok"] else "**a leak**.")]
    for key, title in (("skipped", "Skipped (time budget)"), ("errors", "Errors"), ("notes", "Notes")):
        if res[key]:
            L += ["", f"## {title}", ""] + [f"- {x}" for x in res[key]]
    return "\n".join(L) + "\n"


def parse_levels(spec: str, cap: int) -> list[int]:
    out = []
    for x in spec.split(","):
        c = cap if x.strip() == "max" else int(x)
        if c < 1:
            raise ValueError(f"--concurrency: levels must be >= 1 or 'max', got {x!r}")
        out.append(c)
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve_http", description=__doc__.split("\n\n")[0])
    s = ap.add_argument_group("server (started here unless --url)")
    s.add_argument("--url", default=None, help="a running server's base URL instead of starting one")
    s.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    s.add_argument("--random", choices=["full", "bench", "tiny"], default=None,
                   help="serve the random-weight model of these shapes (benchmarks/serve_random.py)")
    s.add_argument("--fp8", action="store_true", help="with --random: block-FP8 weights")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default=None)
    s.add_argument("--gpu-memory-utilization", type=float, default=None)
    s.add_argument("--memory-budget-gb", type=float, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--num-pages", type=int, default=None)
    s.add_argument("--num-slots", type=int, default=None)
    s.add_argument("--spec-k", type=int, default=None, help="speculative decoding: drafts per step (server flag)")
    s.add_argument("--spec-draft", choices=["ngram", "mtp"], default=None, help="the drafter (server flag)")
    s.add_argument("--spec-oracle", type=float, default=None, metavar="RATE",
                   help="with --random and --spec-k: oracle drafts, RATE x k accepted per step on average")
    s.add_argument("--serve-args", default="", help="more server flags, verbatim (e.g. \"--spec-mode intermediate\")")
    s.add_argument("--startup-timeout", type=float, default=900.0)
    w = ap.add_argument_group("workloads")
    w.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: random,prefix,chat")
    w.add_argument("--concurrency", default="1,16,64,256,max", help="levels C ('max': the server's capacity)")
    w.add_argument("--input-len", type=int, default=None, help="random: input tokens (default 1024)")
    w.add_argument("--output-len", type=int, default=None, help="random: output tokens (default 128)")
    w.add_argument("--num-requests", type=int, default=None,
                   help="random / prefix: requests per level (default 4 x C, at least 16)")
    w.add_argument("--per-level", type=int, default=None, help="random / prefix: N = this x C requests (default 4)")
    w.add_argument("--min-requests", type=int, default=None, help="random / prefix: at least this many (default 16)")
    w.add_argument("--vocab-size", type=int, default=None, help="random token ids below this (default: the model's)")
    w.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("output")
    o.add_argument("--quick", action="store_true", help="CPU smoke: embedded model, tiny I/O, concurrency 1,4")
    o.add_argument("--model-json", type=Path, default=None, help="a bench model JSON: its decode rows fill the "
                   "ceiling column")
    o.add_argument("--tag", default=None, help="file tag (default: the device slug, + _fp8)")
    o.add_argument("--solo-check", type=int, default=4, help="after the levels, replay this many requests of the "
                   "most concurrent random and prefix levels alone and compare the greedy texts (0: off)")
    o.add_argument("--time-budget", type=float, default=1e9, help="seconds after which remaining levels are skipped")
    o.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help=f"output folder (default {DEFAULT_RESULTS})")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.quick:
        args.device = "cpu" if args.device == "auto" else args.device
        if args.concurrency == build_parser().get_default("concurrency"):
            args.concurrency = "1,4"
    given = {"input_len": args.input_len, "output_len": args.output_len, "num_requests": args.num_requests,
             "per_level": args.per_level, "min_requests": args.min_requests}
    sizes = Sizes(**{**vars(sizes), **{k: v for k, v in given.items() if v is not None}})
    workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    bad = sorted(set(workloads) - set(WORKLOADS))
    needs_random = args.fp8 or args.spec_oracle is not None
    if bad or (needs_random and not args.random) or (args.url and (args.random or args.model)):
        print(f"bench_serve_http: unknown workloads {bad}" if bad else "bench_serve_http: --fp8 and --spec-oracle "
              "need --random; --url takes neither --random nor --model", file=sys.stderr)
        return 2
    from benchmarks.bench_ops import _git, _versions, device_name, device_slug, resolve_device
    dev = None if args.url else resolve_device(args.device)
    args.device = str(dev) if dev is not None else args.device
    dtype = args.dtype or ("bfloat16" if dev is not None and dev.type == "cuda" else "float32")
    fmt = "fp8" if args.fp8 else {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    tag = args.tag or (device_slug(dev) if dev is not None else "remote") + ("_fp8" if args.fp8 else "")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"serve_http_{tag}"
    model_json = json.loads(args.model_json.read_text()) if args.model_json else None
    git = _git() or {}
    res: dict[str, Any] = {"schema": 1, "bench": "serve_http", "device": device_name(dev) if dev else args.url,
                           "date": _dt.date.today().isoformat(), **_versions(),
                           "git": f"{git.get('commit', '?')}{' dirty' if git.get('dirty') else ''}",
                           "argv": sys.argv if argv is None else ["bench_serve_http", *argv], "quick": args.quick,
                           "sizes": vars(sizes) | {"cand_len": list(sizes.cand_len)}, "server": args.url or "",
                           "banner": [], "rows": [], "skipped": [], "errors": [], "notes": [], "solo": {}, "leaks": None,
                           "complete": False}
    t_start = time.perf_counter()

    def write() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        stem.with_suffix(".json").write_text(jsonfmt.dumps(res))
        stem.with_suffix(".md").write_text(markdown(res))

    server = None
    try:
        if args.url is None:
            log = Path(tempfile.gettempdir()) / f"gdnserve_bench_serve_http_{os.getpid()}.log"
            print(f"[serve_http] starting the server (log {log})", file=sys.stderr, flush=True)
            server = Server(args, log)
            res["server"], res["banner"] = " ".join(["python", *server.command[1:]]), server.banner()
        url = args.url or server.url
        model = server_facts(url)
        cap = max_concurrency(res["banner"], args.max_num_seqs or 64)
        levels = parse_levels(args.concurrency, cap)
        chars, spec = args.random is not None, spec_label(args)
        vocab = vocab_of(args)
        # warm-up, not a row: the small shapes, then one request at the measured input length (its first long
        # prefill compiles kernels and fills allocator caches: 2.8 s of the first C = 1 row's TTFT on the H200)
        asyncio.run(run_level(url, model, "random", 1, QUICK, vocab, chars, args.seed))
        warm = dataclasses.replace(sizes, output_len=min(sizes.output_len, 4), per_level=1, min_requests=1,
                                   num_requests=1)
        asyncio.run(run_level(url, model, "random", 1, warm, vocab, chars, args.seed + 1))
        last: dict[str, list[Record]] = {}       # the most concurrent level's records per workload (solo check)
        for workload in workloads:
            for C in levels:
                what = f"{workload} C={C}"
                if time.perf_counter() - t_start > args.time_budget:
                    res["skipped"].append(what)
                    continue
                before = spec_counts(url) if args.spec_k else None
                recs, wall, cpu = asyncio.run(run_level(url, model, workload, C, sizes, vocab, chars, args.seed))
                after = spec_counts(url) if before is not None else None
                acc = round((after[1] - before[1]) / (after[0] - before[0]), 3) \
                    if after is not None and after[0] > before[0] else None
                row = summarize(workload, fmt, C, recs, wall, cpu, ceiling_for(model_json, fmt, C), spec, acc)
                res["rows"].append(row)
                last[workload] = recs
                print(f"[serve_http {time.perf_counter() - t_start:6.0f}s] {what} (spec {spec}, acceptance {acc}): "
                      f"{row['output_tok_s']} out tok/s, "
                      f"TTFT p50 {row['ttft_p50_ms']} ms, TPOT p50 {row['tpot_p50_ms']} ms, {row['errors']} errors",
                      file=sys.stderr, flush=True)
                write()
        for workload in ("random", "prefix"):           # chat turns replay the same bodies; the first two suffice
            picked = [r for r in last.get(workload, []) if r.ok][:args.solo_check]
            if picked:
                res["solo"][workload] = asyncio.run(solo_check(url, model, picked, chars))
        res["leaks"] = leak_check(url)
        if not res["leaks"]["ok"]:
            res["errors"].append(f"leak after the run: {res['leaks']}")
        write()
        res["complete"] = True
    except Exception as e:  # noqa: BLE001  recorded; the partial result is written
        res["errors"].append(f"{type(e).__name__}: {e}"[:2000])
    finally:
        if server is not None:
            server.stop()
        write()
    print(markdown(res))
    return 1 if res["errors"] or any(r["errors"] for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
