"""Per-replica series on the ingress's ``/metrics``, beside the merged ones the server exports from
``RemoteEngineClient.stats()`` (the sum over replicas): ``gdnserve:replica_<name>{replica="<id>"}`` for the
engine gauges and counters of ``entrypoints/metrics.py``, from each replica's last routing-stats report
(as fresh as ``stats_period_s``). A replica that died leaves the per-replica series; the merged counters stay
monotonic (the server's collector keeps their highest value)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gdnserve.entrypoints.metrics import _COUNTERS, _GAUGES, P

PR = P + "replica_"


class ReplicaCollector:
    def __init__(self, client: Any) -> None:
        self.client = client

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        per = self.client.replica_stats()
        up = GaugeMetricFamily(PR + "up", "Engine replicas reporting to this ingress's router.", value=len(per))
        yield up
        for key, (name, help_) in _GAUGES.items():
            fam = GaugeMetricFamily(PR + name, help_ + " Per replica.", labels=["replica"])
            for rid, st in sorted(per.items()):
                fam.add_metric([rid], float(st.get(key, 0) or 0))
            yield fam
        for key, (name, help_, label) in _COUNTERS.items():
            fam = CounterMetricFamily(PR + name, help_ + " Per replica.", labels=["replica"])
            for rid, st in sorted(per.items()):
                v = st.get(key, 0)
                fam.add_metric([rid], float(sum(v.values()) if isinstance(v, dict) else v or 0))
            yield fam
