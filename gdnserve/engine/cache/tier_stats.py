"""TierStats: the counters of the checkpoint tiers (engine/cache/checkpoint_tiers.py) that /metrics reads. A leaf module
(no torch), so the server's metrics import it without the engine."""
from __future__ import annotations

import bisect
import threading

TIERS = ("gpu", "host", "disk")
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class TierStats:
    """Counters of the tiers, read by /metrics (entrypoints/metrics.py): hits per tier, restores per source tier,
    spills (device -> host copies; those made ahead of need; evictions that had to copy down then), spills dropped
    (no tier had room), disk writes, bytes moved per direction, and the restore latency (lookup to READY) as
    histogram bucket counts. Written by the engine thread and the disk thread (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = dict.fromkeys(TIERS, 0)
        self.restores = {"host": 0, "disk": 0}
        self.restore_failures = 0
        self.spills = 0
        self.dropped = 0        # evicted READY checkpoints no lower tier could take (host arena full, no disk tier)
        self.spills_ahead = 0   # of the spills: copied down ahead of need (the free-slot watermark)
        self.evictions_waited = 0   # evictions that copied their checkpoint down then (no copy made ahead)
        self.bytes = {"d2h": 0, "h2d": 0, "disk_write": 0, "disk_read": 0}
        self.buckets = [0] * (len(RESTORE_BUCKETS) + 1)     # the last: above every bound
        self.restore_sum = 0.0

    def add_bytes(self, what: str, n: int) -> None:
        with self._lock:
            self.bytes[what] += n

    def hit(self, tier: str) -> None:
        with self._lock:
            self.hits[tier] += 1

    def restored(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.restores[tier] += 1
            self.buckets[bisect.bisect_left(RESTORE_BUCKETS, seconds)] += 1
            self.restore_sum += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"hits": dict(self.hits), "restores": dict(self.restores), "spills": self.spills,
                    "spills_ahead": self.spills_ahead, "evictions_waited": self.evictions_waited,
                    "dropped": self.dropped, "restore_failures": self.restore_failures, "bytes": dict(self.bytes),
                    "restore_buckets": list(zip(RESTORE_BUCKETS, self.buckets)), "restore_inf": self.buckets[-1],
                    "restore_sum": self.restore_sum}
