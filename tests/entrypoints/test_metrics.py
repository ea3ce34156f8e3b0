"""/metrics (issue 13): parsed with prometheus-client's own parser; every name in docs/serving.md's table is
scraped with its documented type and nothing undocumented is; counters are counters; the latency histograms
fill from traffic; the engine's step reports (its public observer hook) time steps and queue time."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

# test-only dependencies (the [test] extra); a machine without them skips this file with the reason
httpx = pytest.importorskip("httpx")

from gdnserve.engine.scheduling.engine_stats import StepReport
from gdnserve.entrypoints.metrics import ServerMetrics, observe_steps
from tests.entrypoints.fake_engine import FakeEngine, Served

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
ROW = re.compile(r"^\| `((?:gdnserve:|process_)[a-z0-9_:]+)` \| (counter|gauge|histogram) \|")


def documented() -> dict[str, str]:
    rows = dict(m.groups() for line in DOCS.read_text().splitlines() if (m := ROW.match(line)))
    if not sys.platform.startswith("linux"):  # the process collector reads /proc
        rows = {k: v for k, v in rows.items() if not k.startswith("process_")}
    return rows


def scraped(text: str) -> dict[str, str]:
    """name -> type, counters under their sample name (``..._total``), as the docs write them."""
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def check_against_docs(text: str) -> None:
    docs, got = documented(), scraped(text)
    assert len(docs) >= 25
    assert set(got) - set(docs) == set(), "undocumented metrics (add them to docs/serving.md)"
    assert set(docs) - set(got) == set(), "documented metrics missing from /metrics"
    assert got == docs  # and each with its documented type
    assert all(n.startswith(("gdnserve:", "process_")) for n in got)


@pytest.fixture(scope="module")
def served():
    s = Served(FakeEngine())
    yield s
    s.stop()


def test_metrics_match_the_docs_and_fill(served):
    with httpx.Client(base_url=served.url, timeout=10) as c:
        before = samples(c.get("/metrics").text)
        assert c.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 5, "n": 2}).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "s"}],
                                                             "max_tokens": 3, "stream": True}) as r:
            r.read()
        assert c.post("/v1/completions", json={"prompt": ""}).status_code == 400
        assert c.get("/v1/models", headers={"host": "evil.com"}).status_code == 403
        r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    check_against_docs(r.text)
    after = samples(r.text)

    def grew(name: str, labels: tuple = (), by: float = 1) -> bool:
        return after.get((name, labels), 0) - before.get((name, labels), 0) >= by
    assert grew("gdnserve:time_to_first_token_seconds_count", by=2)
    assert grew("gdnserve:e2e_request_latency_seconds_count", by=2)
    assert grew("gdnserve:inter_token_latency_seconds_count", by=4 + 2)   # 5 outputs and 3 outputs
    assert grew("gdnserve:request_success_total", (("finished_reason", "length"),), by=3)  # n = 2, then 1
    assert grew("gdnserve:generation_tokens_total", by=13)
    assert grew("gdnserve:http_requests_total", (("route", "/v1/completions"), ("status", "200")))
    assert grew("gdnserve:http_requests_total", (("route", "/v1/completions"), ("status", "400")))
    assert grew("gdnserve:http_requests_total", (("route", "/v1/models"), ("status", "403")))
    assert after[("gdnserve:kv_cache_usage_perc", ())] == pytest.approx(3 / 128)
    assert after[("gdnserve:state_pool_slots_total", ())] == 64
    hist = {k: v for k, v in after.items() if k[0] == "gdnserve:time_to_first_token_seconds_bucket"}
    assert hist[("gdnserve:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == \
        after[("gdnserve:time_to_first_token_seconds_count", ())]


class _Stats:
    def __init__(self) -> None:
        self.s = {"checkpoints_published": 5, "checkpoint_misses": {"absent": 3}, "tokens_generated": 7,
                  "running": 2, "something_new": 1}

    def stats(self) -> dict:
        return dict(self.s)


def test_counters_stay_monotonic_and_unknown_keys_stay_out():
    eng = _Stats()
    m = ServerMetrics(eng)
    first = samples(m.render().decode())
    eng.s["checkpoints_published"], eng.s["checkpoint_misses"] = 4, {"absent": 2, "evicted": 1}  # taken back
    second = samples(m.render().decode())
    assert first[("gdnserve:checkpoints_published_total", ())] == second[("gdnserve:checkpoints_published_total", ())] == 5
    assert second[("gdnserve:checkpoint_misses_total", (("reason", "absent"),))] == 3
    assert second[("gdnserve:checkpoint_misses_total", (("reason", "evicted"),))] == 1
    assert second[("gdnserve:num_requests_running", ())] == 2
    assert not any("something_new" in k[0] for k in second)
    assert not m.step_observed  # no engine step to watch: the step / queue histograms stay empty


def test_step_observer_times_steps_and_queue_time():
    """The server observes steps through the engine's public hook (no wrapping of the engine's methods): each
    report's duration, and the queue time of the tracked requests it admitted; a second app on the same engine
    takes the observations over."""
    class Engine:
        observer = None

        def set_step_observer(self, fn) -> None:
            self.observer = fn

        def stats(self) -> dict:
            return {}

        def step(self, admitted: tuple[str, ...]) -> None:
            self.observer(StepReport(time.monotonic(), 0.002, admitted))

    eng = Engine()
    m = ServerMetrics(eng)
    assert m.step_observed and eng.observer == m.on_step
    m.arrivals.update(a=time.monotonic() - 0.5, b=time.monotonic())
    eng.step(("a", "untracked"))
    s = samples(m.render().decode())
    assert s[("gdnserve:engine_step_time_seconds_count", ())] == 1
    assert s[("gdnserve:request_queue_time_seconds_count", ())] == 1
    assert s[("gdnserve:request_queue_time_seconds_sum", ())] >= 0.5
    assert set(m.arrivals) == {"b"}
    m2 = ServerMetrics(eng)        # a second app on the same engine: the observations move to it
    assert observe_steps(eng, m2) and eng.observer == m2.on_step
    m2.arrivals["b"] = time.monotonic()
    eng.step(("b",))
    assert not m2.arrivals
    assert samples(m2.render().decode())[("gdnserve:engine_step_time_seconds_count", ())] == 1
    assert samples(m.render().decode())[("gdnserve:engine_step_time_seconds_count", ())] == 1


def test_the_engine_reports_its_steps_and_admissions():
    """LLMEngine.set_step_observer: one report per step() with the ids it admitted (out of the queue), none for
    a request still waiting; the server's histograms read these (no monkeypatching of engine.step)."""
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.entrypoints.llm import LLM
    e = LLM(device="cpu", max_num_seqs=1, num_pages=64).engine
    reports = []
    e.set_step_observer(reports.append)
    a = e.add_request(None, "first prompt", SamplingParams(temperature=0, max_tokens=2))
    b = e.add_request(None, "second prompt", SamplingParams(temperature=0, max_tokens=2))
    e.step()
    assert len(reports) == 1 and reports[0].admitted == (a,) and reports[0].seconds > 0
    while e.has_unfinished():
        e.step()
    assert [r.admitted for r in reports if r.admitted] == [(a,), (b,)]
    e.set_step_observer(None)
    n = len(reports)
    e.add_request(None, "third", SamplingParams(temperature=0, max_tokens=1))
    e.step()
    assert len(reports) == n
