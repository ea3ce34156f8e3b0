"""CheckpointAffinityRouter.choose_replicas on stand-in replicas (no Ray cluster): the holder of a READY or PENDING
key wins, a new key's first placement is kept for its group, an automatic checkpoint is found at a reported or
learned length, the less loaded of two otherwise, and a dead replica's checkpoints are forgotten with it."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from gdnserve.replicas.keys import generate_route, prefix_key, score_route  # noqa: E402
from gdnserve.replicas.router import CheckpointAffinityRouter  # noqa: E402

DEP = DeploymentID(name="GdnEngine", app_name="unit")


class _Replica:
    def __init__(self, uid: str, **stats) -> None:
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEP)
        self.routing_stats = stats
        self.max_ongoing_requests = 100
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _router(*replicas: _Replica) -> CheckpointAffinityRouter:
    r = CheckpointAffinityRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN,
                                 create_replica_wrapper_func=lambda info: info)
    r.initialize_state()
    r.update_replicas(list(replicas))
    return r


def _in_loop(fn):
    """Run the test body on an event loop (the router schedules its queue-length probes on it)."""
    def run(*args, **kwargs):
        async def body():
            return fn(*args, **kwargs)
        return asyncio.run(body())
    run.__name__ = fn.__name__
    return run


def _choose(router, route) -> _Replica:
    ranks = router.choose_replicas(list(router.curr_replicas.values()),
                                   SimpleNamespace(kwargs={"route": route}, args=[], metadata=None))
    try:
        ranks.send(None)
    except StopIteration as done:      # choose_replicas awaits nothing: it finishes on its first step
        return done.value[0][0]
    raise AssertionError("choose_replicas awaited")


def test_holders_first_then_least_loaded(seed):
    _in_loop(_holders_first)(seed)


def _holders_first(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(1, 500) for _ in range(rng.randint(20, 60))]
    c = rng.randint(5, len(ids) - 2)
    marked = generate_route(ids, c)
    a, b, d = _Replica("a", queue_depth=0), _Replica("b", ready=[marked.exact], queue_depth=9), _Replica("d")
    router = _router(a, b, d)
    assert _choose(router, marked) is b                              # READY there, however loaded
    sp = score_route(ids)
    d.routing_stats = {"pending": [sp.exact]}
    assert _choose(router, sp) is d                                  # PENDING there: producing it
    fresh = generate_route([7] + ids, c + 1)
    first = _choose(router, fresh)
    assert all(_choose(router, fresh) is first for _ in range(5))    # its group follows it before any report
    assert first is not b or len(router.curr_replicas) == 1          # b (load 9) loses both draws it is in


def test_conversation_checkpoint_at_reported_or_learned_length(seed):
    _in_loop(_conversation)(seed)


def _conversation(seed):
    rng = random.Random(seed)
    turn1 = [rng.randrange(1, 500) for _ in range(rng.randint(20, 60))]
    L = len(turn1) - rng.randint(1, 5)
    a, b = _Replica("a"), _Replica("b", ready=[prefix_key(turn1, L)], lengths=[L, L + 100])
    router = _router(a, b)
    nxt = generate_route(turn1 + [1, 2, 3], None)
    assert nxt.exact is None and _choose(router, nxt) is b
    b.routing_stats = {}
    router.learn("a", prefix_key(turn1, L - 1), L - 1)                # told by the client, not yet reported
    assert _choose(router, nxt) is a


def test_dead_replica_is_forgotten(seed):
    _in_loop(_dead)(seed)


def _dead(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(1, 500) for _ in range(30)]
    route = generate_route(ids, 20)
    a, b = _Replica("a"), _Replica("b")
    router = _router(a, b)
    holder = _choose(router, route)
    router.on_replica_actor_died(holder.replica_id)
    other = b if holder is a else a
    assert list(router.curr_replicas.values()) == [other]
    assert not router._local or all(rid == other.replica_id for rid, _, _ in router._local.values())
    assert _choose(router, route) is other
