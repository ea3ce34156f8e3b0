"""Ray Serve request routers for the engine deployment (``RequestRouterConfig(request_router_class=...)``).

:class:`CheckpointAffinityRouter` sends a request to the replica that holds (READY) or is producing (PENDING)
the checkpoint it needs (``keys.Route``), else to the less loaded of two random replicas (power of two
choices), and remembers that choice at once, so the rest of the group follows its producer even before the
replica's next report. What each replica holds comes from two sources:

- its routing stats (``EngineReplica.record_routing_stats``, polled by Serve every
  ``request_routing_stats_period_s``): READY and PENDING keys, the distinct READY lengths, queue depth (READY
  includes the checkpoints in the replica's host and disk tiers: a lookup there restores them; the router makes
  no difference between tiers, the least loaded holder wins);
- what this router did or was told: the replica it sent a boundary to (PENDING until reported), and the
  automatic or marker checkpoint a finished request published there (``learn``, called by the ingress's
  ``RemoteEngineClient``). These expire after ``ttl_s``; from then on the reports decide.

A replica Serve reports dead (``on_replica_actor_died``) or removed (``update_replicas``) takes its entries
with it: its checkpoints are recomputed wherever the next request lands. Load = the larger of this router's
in-flight requests on the replica and the replica's reported queue depth + running requests.

:class:`DefaultRouter` is Ray Serve's own power-of-two-choices router, unchanged, registered like the affinity
router so that the ingress can read its replicas' stats (``/metrics``); it is the baseline of the tests and
the benchmark. ``registry.routers_for`` finds the routers of a deployment in this process."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from gdnserve.replicas import registry
from gdnserve.replicas.keys import Route, prefix_key

MAX_LENGTHS = 256     # automatic-checkpoint lookups per request: the longest READY lengths first


@dataclass(slots=True)
class _View:
    """One replica's last report, parsed once per report."""
    ready: set[bytes] = field(default_factory=set)
    pending: set[bytes] = field(default_factory=set)
    lengths: tuple[int, ...] = ()
    load: int = 0


class _Registered:
    """Registers the router per deployment and reads its replicas' routing stats."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        registry.register(self._deployment_id.app_name, self._deployment_id.name, self)

    def replica_reports(self) -> dict[str, dict[str, Any]]:
        """unique replica id -> its last routing stats (empty before its first report)."""
        # called from the ingress's event loop: a copy of the router's dict (Serve routes on its own loop)
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in list(self.curr_replicas.items())}

    def learn(self, replica: str, key: bytes, length: int) -> None:  # noqa: ARG002  the default router keeps nothing
        return None


class DefaultRouter(_Registered, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router (power of two choices on queue length), for comparison."""


class CheckpointAffinityRouter(_Registered, RequestRouter):
    def initialize_state(self, ttl_s: float = 30.0, **kwargs: Any) -> None:
        self._ttl = float(ttl_s)
        self._local: dict[bytes, tuple[ReplicaID, float, int | None]] = {}   # key -> replica, when, READY length
        self._lock = threading.Lock()   # learn() comes from the caller's event loop, the routing from Serve's
        self._inflight: dict[ReplicaID, int] = {}
        self._views: dict[ReplicaID, tuple[int, _View]] = {}
        self.routed = {"affinity": 0, "balanced": 0}

    # ---- what the replicas hold --------------------------------------------------------------------
    def _view(self, r: RunningReplica) -> _View:
        stats = r.routing_stats or {}
        got = self._views.get(r.replica_id)
        if got is not None and got[0] == id(stats):
            return got[1]
        v = _View(set(stats.get("ready", ())), set(stats.get("pending", ())), tuple(stats.get("lengths", ())),
                  int(stats.get("queue_depth", 0)) + int(stats.get("running", 0)))
        self._views[r.replica_id] = (id(stats), v)
        return v

    def _load(self, r: RunningReplica) -> int:
        return max(self._inflight.get(r.replica_id, 0), self._view(r).load)

    def _local_at(self, key: bytes, now: float) -> tuple[ReplicaID, int | None] | None:
        got = self._local.get(key)
        if got is None:
            return None
        if now - got[1] > self._ttl:
            self._local.pop(key, None)
            return None
        return got[0], got[2]

    def learn(self, replica: str, key: bytes, length: int) -> None:
        """A checkpoint of ``length`` tokens is READY on the replica with this unique id."""
        rid = next((r for r in list(self.curr_replicas) if r.unique_id == replica), None)
        if rid is not None:
            with self._lock:
                self._local[key] = (rid, time.monotonic(), length)

    def _holders(self, route: Route, replicas: list[RunningReplica], now: float) -> list[RunningReplica]:
        if route.exact is not None:
            local = self._local_at(route.exact, now)
            return [r for r in replicas if route.exact in self._view(r).ready or route.exact in self._view(r).pending
                    or (local is not None and local[0] == r.replica_id)]
        if route.prompt is None:
            return []
        n = len(route.prompt)
        lengths = {L for r in replicas for L in self._view(r).lengths if L < n}
        lengths |= {L for _, t, L in self._local.values() if L is not None and L < n and now - t <= self._ttl}
        for L in sorted(lengths, reverse=True)[:MAX_LENGTHS]:
            key = prefix_key(route.prompt, L)
            local = self._local_at(key, now)
            found = [r for r in replicas if key in self._view(r).ready
                     or (local is not None and local[0] == r.replica_id)]
            if found:
                return found
        return []

    # ---- the choice ----------------------------------------------------------------------------------
    def _least_loaded_of_two(self, replicas: list[RunningReplica]) -> RunningReplica:
        two = random.sample(replicas, 2) if len(replicas) > 1 else replicas
        return min(two, key=self._load)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route = None if pending_request is None else pending_request.kwargs.get("route")
        now = time.monotonic()
        with self._lock:
            holders = self._holders(route, candidate_replicas, now) if isinstance(route, Route) else []
            if holders:
                pick = min(holders, key=self._load)
                self.routed["affinity"] += 1
            else:
                pick = self._least_loaded_of_two(candidate_replicas)
                self.routed["balanced"] += 1
                if route is not None and route.exact is not None:   # the group follows its producer from now on
                    self._local[route.exact] = (pick.replica_id, now, None)
        rest = [r for r in candidate_replicas if r is not pick]
        # the pick first; if its queue is full, the less loaded of two others (Serve probes queue lengths)
        return [[pick], random.sample(rest, min(2, len(rest)))] if rest else [[pick]]

    # ---- bookkeeping --------------------------------------------------------------------------------
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._inflight.get(replica_id, 0) > 0:
            self._inflight[replica_id] -= 1

    def _forget(self, alive: set[ReplicaID]) -> None:
        with self._lock:
            for key in [k for k, (rid, _, _) in self._local.items() if rid not in alive]:
                del self._local[key]
        for d in (self._inflight, self._views):
            for rid in [r for r in d if r not in alive]:
                del d[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(set(self.curr_replicas))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget(set(self.curr_replicas))
