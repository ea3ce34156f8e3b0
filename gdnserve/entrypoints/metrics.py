"""``/metrics`` through ``prometheus-client``, named as vLLM names its metrics with a ``gdnserve:`` prefix.

- Engine state and engine counters are read from ``engine.stats()`` at scrape time by a collector
  (counters as counters, gauges as gauges).
- Latency histograms are observed by the server: time to first token, inter-token latency, end-to-end
  latency (from the arrival of the HTTP request), and, from the engine's per-step reports (the observer it
  registers with ``engine.set_step_observer``), queue time (submission to admission) and step time.
- HTTP responses are counted by route and status by an ASGI middleware.

``docs/serving.md`` lists every name; ``tests/entrypoints/test_metrics.py`` checks the list against a
scrape in both directions.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gdnserve.engine.cache.tier_stats import TierStats

prometheus_client.disable_created_metrics()  # no *_created series (vLLM does the same)

P = "gdnserve:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/models", "/health", "/metrics")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# engine.stats() key -> (name without prefix, help); gauges
_GAUGES = {
    "running": ("num_requests_running", "Requests being prefilled or decoded."),
    "queue_depth": ("num_requests_waiting", "Requests waiting to be admitted."),
    "state_pool_used": ("state_pool_slots_used", "Recurrent-state slots in use (requests + checkpoints)."),
    "state_pool_total": ("state_pool_slots_total", "Recurrent-state slots."),
    "page_pool_used": ("kv_cache_pages_used", "KV-cache pages in use (requests + checkpoints)."),
    "page_pool_total": ("kv_cache_pages_total", "KV-cache pages."),
    "checkpoints_ready": ("checkpoints_ready", "READY checkpoints held (each holds one state slot)."),
}
# engine.stats() key -> (name without prefix and _total, help, label of a dict value); counters
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed.", None),
    "tokens_generated": ("generation_tokens", "Tokens generated.", None),
    "checkpoint_hits": ("checkpoint_hits", "Requests (and score candidates) that started from a checkpoint.", None),
    "checkpoint_misses": ("checkpoint_misses", "Checkpoint lookups that missed, by reason.", "reason"),
    "checkpoints_published": ("checkpoints_published", "Checkpoints published.", None),
    "preemptions": ("num_preemptions", "Requests preempted for lack of pages or slots.", None),
    "spec_drafted": ("spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding.", None),
    "spec_accepted": ("spec_decode_num_accepted_tokens", "Draft tokens accepted by speculative decoding.", None),
}
_USAGE = {"state_pool": "state_pool_usage_perc", "page_pool": "kv_cache_usage_perc"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _EngineCollector:
    """engine.stats() as metric families at scrape time. Counters are exported monotonic: a count the
    engine takes back (a PENDING checkpoint whose producer was aborted) keeps its highest value."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._high: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def _mono(self, name: str, label: str, v: float) -> float:
        with self._lock:
            v = max(v, self._high.get((name, label), v))
            self._high[(name, label)] = v
            return v

    def describe(self) -> list:
        return []  # names are known only at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001  /health says what is wrong; the scrape still has the rest
            return
        for key, (name, help_) in _GAUGES.items():
            yield GaugeMetricFamily(P + name, help_, value=stats.get(key, 0) if _number(stats.get(key)) else 0)
        for pool, name in _USAGE.items():
            used, total = stats.get(f"{pool}_used"), stats.get(f"{pool}_total")
            frac = used / total if _number(used) and _number(total) and total > 0 else 0.0
            yield GaugeMetricFamily(P + name, f"Fraction of the {pool.replace('_', ' ')} in use (0 to 1).", value=frac)
        for key, (name, help_, label) in _COUNTERS.items():
            value = stats.get(key, 0 if label is None else {})
            if label is None:
                yield CounterMetricFamily(P + name, help_, value=self._mono(name, "", value if _number(value) else 0))
                continue
            fam = CounterMetricFamily(P + name, help_, labels=[label])
            for k, v in sorted((value if isinstance(value, dict) else {}).items()):
                if _number(v):
                    fam.add_metric([str(k)], self._mono(name, str(k), v))
            yield fam


class _TierCollector:
    """The checkpoint tiers' TierStats (engine/cache/checkpoint_tiers.py) at scrape time: hits per tier, restores per
    source tier, device -> host copies, bytes moved per direction, and the restore latency histogram (all at 0 for
    an engine without tiers, so the series exist on every server)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        inner = getattr(self.engine, "engine", self.engine)
        try:
            ts = getattr(inner, "tier_stats", None)
            snap = (ts if ts is not None else TierStats()).snapshot()     # without tiers: every series at 0
        except Exception:  # noqa: BLE001  a scrape never fails for the tiers
            return
        for name, help_, label, values in (
                ("checkpoint_tier_hits", "Checkpoint hits by the tier the checkpoint was found in.", "tier",
                 snap["hits"]),
                ("checkpoint_restores", "Checkpoints restored to the GPU, by source tier.", "tier", snap["restores"]),
                ("checkpoint_tier_bytes", ("Bytes of checkpoints moved between tiers, by direction (d2h, h2d, "
                                           "disk_write, disk_read)."), "direction", snap["bytes"])):
            fam = CounterMetricFamily(P + name, help_, labels=[label])
            for k, v in sorted(values.items()):
                fam.add_metric([k], v)
            yield fam
        yield CounterMetricFamily(P + "checkpoint_spills", "READY checkpoints copied down from the GPU (on eviction, "
                                  "or ahead of it).", value=snap["spills"])
        yield CounterMetricFamily(P + "checkpoint_spills_ahead", "Of the spills: READY checkpoints copied down "
                                  "ahead of need (the free-slot watermark), freed later without a copy.",
                                  value=snap["spills_ahead"])
        yield CounterMetricFamily(P + "checkpoint_evictions_waited", "GPU evictions that copied their checkpoint "
                                  "down then (no copy made ahead): the step after waits for its gather.",
                                  value=snap["evictions_waited"])
        yield CounterMetricFamily(P + "checkpoint_spills_dropped", "READY checkpoints evicted from the GPU that no "
                                  "lower tier could take (the host arena full, no disk tier).", value=snap["dropped"])
        yield CounterMetricFamily(P + "checkpoint_restore_failures", "Restores that failed (a corrupt or vanished "
                                  "file): the request missed.", value=snap["restore_failures"])
        cum, buckets = 0, []
        for bound, n in snap["restore_buckets"]:
            cum += n
            buckets.append((repr(float(bound)), cum))
        buckets.append(("+Inf", cum + snap["restore_inf"]))
        yield HistogramMetricFamily(P + "checkpoint_restore_seconds", "Time from the lookup that found a checkpoint "
                                    "in a lower tier to its READY on the GPU.", buckets=buckets,
                                    sum_value=snap["restore_sum"])


class ServerMetrics:
    """One registry per app (several apps in one process, as in the tests, do not collide)."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        self.registry.register(_TierCollector(engine))
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from the HTTP request's arrival to the "
                              "first output of each of its prompts.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive outputs of one prompt.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from the HTTP request's arrival to the "
                             "finished output of each of its prompts.", buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time from submission to the engine to the "
                               "start of the step that admitted the request.", buckets=REQUEST_BUCKETS, registry=r)
        self.step = Histogram(P + "engine_step_time_seconds", "Duration of one engine step.", buckets=STEP_BUCKETS,
                              registry=r)
        self.success = Counter(P + "request_success", "Finished samples (choices), by finish reason.",
                               ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):   # exported from the start, at 0
            self.success.labels(reason)
        self.http = Counter(P + "http_requests", "HTTP responses, by route and status code.", ["route", "status"],
                            registry=r)
        self.arrivals: dict[str, float] = {}  # engine request id -> when it was submitted (until admitted)
        self.step_observed = observe_steps(engine, self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, report: Any) -> None:
        """One engine step (engine/scheduling/engine_stats.py StepReport; the engine thread): its duration, and the queue
        time of each tracked request it admitted (submission to the step's start)."""
        self.step.observe(report.seconds)
        for rid in report.admitted:
            t = self.arrivals.pop(rid, None)
            if t is not None:
                self.queue.observe(max(report.start - t, 0.0))

    def track(self, arrival: float, request_ids: Sequence[str]) -> RequestTimer:
        return RequestTimer(self, arrival, request_ids)


class RequestTimer:
    """The latency observations of one HTTP request's prompts (index ``i`` = prompt ``i``)."""

    def __init__(self, metrics: ServerMetrics, arrival: float, request_ids: Sequence[str]) -> None:
        self.m, self.arrival, self.rids = metrics, arrival, list(request_ids)
        self.last: dict[int, float] = {}
        self.reasons: dict[int, dict[int, str | None]] = {}   # prompt -> sample index -> its finish reason so far

    def submitted(self, i: int) -> None:
        self.m.arrivals[self.rids[i]] = time.monotonic()

    def output(self, i: int, out: Any) -> None:
        now = time.monotonic()
        prev = self.last.get(i)
        if prev is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            self.m.itl.observe(now - prev)
        self.last[i] = now
        if out.finished:
            self.m.e2e.observe(now - self.arrival)
            for c in out.outputs:
                self.m.success.labels(c.finish_reason or "abort").inc()
        else:
            self.reasons[i] = {c.index: c.finish_reason for c in out.outputs}

    def aborted(self, i: int, n: int) -> None:
        """Prompt ``i``'s request was aborted before its finished output (its client went away, the engine failed
        it): its ``n`` samples count as finished, by their reason where one had already stopped, else ``abort``."""
        reasons = self.reasons.pop(i, {})
        for j in range(n):
            self.m.success.labels(reasons.get(j) or "abort").inc()

    def close(self) -> None:
        for rid in self.rids:
            self.m.arrivals.pop(rid, None)


def observe_steps(engine: Any, metrics: ServerMetrics) -> bool:
    """Register ``metrics`` as the step observer of ``engine`` (``set_step_observer``: AsyncEngine, LLMEngine;
    one observer per engine, so a later app on the same engine takes the observations over). False when the
    engine reports no steps (then the step and queue histograms stay empty)."""
    register = getattr(engine, "set_step_observer", None)
    if not callable(register):
        return False
    register(metrics.on_step)
    return True


class HTTPCounter:
    """ASGI middleware: counts each response by route (the known ones; ``other``) and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(route, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)
