"""CheckpointAffinityRouter.choose_replicas on stand-in replicas (no Ray cluster): the holder of a READY or PENDING
key wins, a new key's first placement is kept for its group, an automatic checkpoint is found at a reported or
learned length, the less loaded of two otherwise, a dead replica's checkpoints are forgotten with it, and a
checkpoint a replica's engine spilled to its host tier still draws its conversation there."""
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


def test_a_checkpoint_in_a_replicas_host_tier_still_draws_its_conversation():
    """Issue 30 leftover: a replica reports the checkpoints of its host and disk tiers as READY (a lookup there
    restores them, 0.075x the recompute on the H200), so the next turn of a conversation whose checkpoint the
    replica spilled below its GPU still goes to it, however loaded (the routing stats of a real engine, through
    ``EngineReplica.record_routing_stats``)."""
    from gdnserve.engine.cache.checkpoint_index import conversation_prefix
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.entrypoints.llm import LLM
    from gdnserve.replicas.engine_replica import EngineReplica

    e = LLM(device="cpu", max_num_seqs=2, num_slots=2, num_pages=64, page_size=8,
            checkpoint_host_memory_gb=0.01).engine
    rng = random.Random(30)
    convs = [[rng.randrange(3, 250) for _ in range(17 + i)] for i in range(3)]
    outs = []
    for c in convs:
        rid = e.add_request(None, c, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while e.has_unfinished():
            outs += [o.outputs[0].token_ids for o in e.step() if o.request_id == rid and o.finished]
    spilled = conversation_prefix(convs[0], outs[0])
    assert prefix_key(spilled, len(spilled)) in e.kv.checkpoint_cache.tiers.host      # 2 slots: the first went down
    stats = EngineReplica.record_routing_stats(SimpleNamespace(engine=e, replica_id="b"))
    _in_loop(_spilled_turn)(stats, convs[0] + outs[0] + [7, 8])


def _spilled_turn(stats, turn):
    a, b, d = _Replica("a"), _Replica("b", **{**stats, "queue_depth": 9}), _Replica("d")
    router = _router(a, b, d)
    assert all(_choose(router, generate_route(turn, None)) is b for _ in range(5))
