"""gdnserve replicas on a local Ray Serve cluster (one per module): 2 replicas of the embedded model behind the
checkpoint-affinity router (app "aff", with the HTTP ingress) and 2 behind Ray Serve's default router (app
"dflt", engines only), each replica 1 CPU. Requests go through ``RemoteEngineClient`` (the ingress's client) from
the test process, whose handles run the same routers; the HTTP test goes through Serve's proxy.

- shared-prefix groups (marker) in random order: affinity = one replica's hit count and greedy outputs; the
  default router splits groups (each replica recomputes the prefix), so fewer hits;
- conversations (second turns, no marker, the first turn's automatic checkpoint): affinity = one replica, the
  default router about half;
- a replica killed mid-run: no request that had not started streaming is lost; its checkpoint is recomputed on
  the replica that next gets its group; the router does not send to the dead one.
"""
from __future__ import annotations

import asyncio
import os
import random
import socket

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from gdnserve.engine.config import EngineConfig  # noqa: E402
from gdnserve.engine.engine_api import GenerateRequest  # noqa: E402
from gdnserve.engine.sampling_params import SamplingParams  # noqa: E402
from gdnserve.entrypoints.config import ServerConfig  # noqa: E402
from gdnserve.replicas.app import ENGINE_DEPLOYMENT, engine_deployment, make_app  # noqa: E402
from gdnserve.replicas.client import RemoteEngineClient, ReplicaDiedError  # noqa: E402
from gdnserve.replicas.engine_replica import ReplicaSpec  # noqa: E402
from gdnserve.replicas.registry import routers_for  # noqa: E402

ENGINE = EngineConfig(model_name="gdnserve-embedded", max_num_seqs=64, num_pages=1024, max_model_len=1024,
                      max_step_tokens=128)
SPEC = ReplicaSpec(device="cpu", engine=ENGINE, torch_threads=1)
KEY = "test-key"
GREEDY = dict(temperature=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    env = {k: os.environ[k] for k in ("TRITON_INTERPRET", "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S",
                                      "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S") if k in os.environ}
    # logical CPUs: 4 engine replicas x 1 CPU (on CI's 2 cores they time-share; nothing here is timed)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env} if env else None)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(make_app(2, SPEC, ServerConfig(api_key=KEY), app_name="aff", router="affinity"),
              name="aff", route_prefix="/")
    serve.run(engine_deployment(2, SPEC, router="default").bind(SPEC), name="dflt", route_prefix=None)
    from gdnserve.models.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    clients = {app: RemoteEngineClient(serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app), tok,
                                       ENGINE.model_name, ENGINE.max_model_len, app_name=app,
                                       deployment=ENGINE_DEPLOYMENT) for app in ("aff", "dflt")}
    try:
        yield {"port": port, "clients": clients}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """One replica: the same engine in this process."""
    from gdnserve.engine.async_engine import AsyncEngine
    from gdnserve.entrypoints.llm import load_engine
    return AsyncEngine(load_engine(None, device="cpu", config=ENGINE))


async def _run(engine, req: GenerateRequest) -> tuple[list[int], int]:
    last = None
    async for out in engine.generate(req):
        last = out
    return last.outputs[0].token_ids, last.checkpoint.hit_length


async def _all(engine, reqs: list[GenerateRequest]) -> list[tuple[list[int], int]]:
    return await asyncio.gather(*(_run(engine, r) for r in reqs))


def _req(rid: str, ids: list[int], max_tokens: int, checkpoint_at: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid, ids, SamplingParams(max_tokens=max_tokens, **GREEDY), checkpoint_at)


def _groups(rng: random.Random, tag: str, groups: int = 8, consumers: int = 6) -> list[GenerateRequest]:
    """Each group: one shared prefix (a marker at its end) + 1 + ``consumers`` requests, shuffled."""
    reqs = []
    for g in range(groups):
        prefix = [rng.randrange(1, 200) for _ in range(rng.randint(33, 61))]
        for c in range(consumers + 1):
            suffix = [rng.randrange(1, 200) for _ in range(rng.randint(3, 9))]
            reqs.append(_req(f"{tag}-g{g}-{c}", prefix + suffix, 2, len(prefix)))
    rng.shuffle(reqs)
    return reqs


def test_affinity_matches_one_replica_default_router_does_not(cluster, reference, seed):
    rng = random.Random(seed)
    aff, dflt = cluster["clients"]["aff"], cluster["clients"]["dflt"]

    async def scenario():
        # 1. shared-prefix groups, every request marked, all at once in random order
        reqs = _groups(rng, "m")
        ref = await _all(reference, reqs)
        got = {name: await _all(c, [_req(f"{name}-{r.request_id}", r.prompt, 2, r.checkpoint_at) for r in reqs])
               for name, c in (("aff", aff), ("dflt", dflt))}
        # 2. conversations: 8 first turns, then 6 second turns each (prompt + answer + more), no marker
        firsts = [_req(f"t1-{g}", [rng.randrange(1, 200) for _ in range(rng.randint(33, 61))], 4) for g in range(8)]
        turns = {}
        for name, c in (("ref", reference), ("aff", aff), ("dflt", dflt)):
            answers = await _all(c, [_req(f"{name}-{r.request_id}", r.prompt, 4) for r in firsts])
            turns[name] = answers
        assert turns["aff"] == turns["ref"] == turns["dflt"]
        seconds = [_req(f"t2-{g}-{j}", firsts[g].prompt + turns["ref"][g][0] + [rng.randrange(1, 200)
                        for _ in range(rng.randint(3, 9))], 2) for g in range(8) for j in range(6)]
        rng.shuffle(seconds)
        conv = {name: await _all(c, [_req(f"{name}-{r.request_id}", r.prompt, 2) for r in seconds])
                for name, c in (("ref", reference), ("aff", aff), ("dflt", dflt))}
        return ref, got, conv

    ref, got, conv = asyncio.run(scenario())
    hits = lambda res: sum(h > 0 for _, h in res)  # noqa: E731
    # groups: one replica and affinity give every consumer a hit (48); the default router splits groups
    assert hits(ref) == 48
    assert hits(got["aff"]) == hits(ref)
    assert [t for t, _ in got["aff"]] == [t for t, _ in ref] == [t for t, _ in got["dflt"]]
    assert hits(got["dflt"]) < hits(ref)
    # conversations: every second turn starts from its first turn's automatic checkpoint on one replica and
    # with affinity; with the default router only those that land where the first turn ran (about half)
    assert hits(conv["ref"]) == 48
    assert hits(conv["aff"]) == 48
    assert 8 <= hits(conv["dflt"]) <= 40, hits(conv["dflt"])
    assert [t for t, _ in conv["aff"]] == [t for t, _ in conv["ref"]] == [t for t, _ in conv["dflt"]]
    print(f"hits: groups ref {hits(ref)} aff {hits(got['aff'])} default {hits(got['dflt'])}; conversations ref "
          f"{hits(conv['ref'])} aff {hits(conv['aff'])} default {hits(conv['dflt'])}")


def test_http_ingress_stream_score_metrics_api_key(cluster):
    import httpx
    base = f"http://127.0.0.1:{cluster['port']}"
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, timeout=120) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
        body = {"prompt": "A long shared document.<|state_checkpoint|> Question one?", "max_tokens": 3,
                "temperature": 0}
        first = c.post("/v1/completions", json=body, headers=auth).json()
        assert first["gdnserve"]["prompts"][0]["published"] is True
        again = c.post("/v1/completions", json={**body, "prompt": body["prompt"].replace("one", "two")},
                       headers=auth).json()
        assert again["gdnserve"]["prompts"][0]["hit_length"] == first["gdnserve"]["prompts"][0]["checkpoint_at"]
        events = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=auth) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      headers=auth)
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        sc = c.post("/v1/score", json={"prefix": "Is it good? Answer:", "candidates": [" yes", " no"]}, headers=auth)
        assert sc.status_code == 200 and len(sc.json()["data"]) == 2
        bad = c.post("/v1/completions", json={"prompt": "a<|state_checkpoint|>b<|state_checkpoint|>c"}, headers=auth)
        assert bad.status_code == 400
        # refused by the engine in its replica (more KV pages than the pool), answered 400 with its own message
        big = c.post("/v1/completions", json={"prompt": "hi", "n": 64, "max_tokens": 1000}, headers=auth)
        assert big.status_code == 400 and "KV pages" in big.json()["error"]["message"], big.text
        assert c.get("/metrics").status_code == 401
        text = ""
        for _ in range(60):     # the replicas report every second
            text = c.get("/metrics", headers=auth).text
            if "gdnserve:replica_up 2.0" in text and _metric(text, "gdnserve:checkpoint_hits_total") >= 1:
                break
            asyncio.run(asyncio.sleep(0.5))
        assert "gdnserve:replica_up 2.0" in text
        per = [line for line in text.splitlines() if line.startswith("gdnserve:replica_checkpoint_hits_total{")]
        assert len(per) == 2
        assert sum(float(line.rsplit(" ", 1)[1]) for line in per) == _metric(text, "gdnserve:checkpoint_hits_total")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _replica_actor(app: str, unique_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].endswith(f"{app}#{ENGINE_DEPLOYMENT}#{unique_id}"):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for replica {unique_id}")


def test_killed_replica_loses_only_streaming_requests(cluster, seed):
    rng = random.Random(seed)
    client = cluster["clients"]["aff"]
    prefix = [rng.randrange(1, 200) for _ in range(40)]

    async def scenario():
        await _run(client, _req("k-producer", prefix + [5, 6, 7], 1, len(prefix)))
        router = routers_for("aff", ENGINE_DEPLOYMENT)[0]
        from gdnserve.engine.cache.checkpoint_index import checkpoint_key
        holder = router._local[checkpoint_key(prefix)][0]
        started: dict[str, bool] = {}
        first = asyncio.Event()

        async def one(req):
            started[req.request_id] = False
            try:
                async for _ in client.generate(req):
                    started[req.request_id] = True
                    first.set()
                return "ok"
            except ReplicaDiedError:
                return "lost while streaming" if started[req.request_id] else "lost before streaming"

        # long prompts, prefilled 128 tokens a step: most wait in their engine's queue when the kill comes
        reqs = [_req(f"k-{i}", [rng.randrange(1, 200) for _ in range(rng.randint(250, 320))], 8) for i in range(24)]
        tasks = [asyncio.create_task(one(r)) for r in reqs]
        await first.wait()
        ray.kill(_replica_actor("aff", holder.unique_id), no_restart=True)
        results = await asyncio.gather(*tasks)
        # the group whose checkpoint lived on the dead replica: recomputed where it goes now
        after = await _all(client, [_req(f"k-consumer-{j}", prefix + [9, j + 1], 1, len(prefix)) for j in range(3)])
        return results, after, holder, router

    results, after, holder, router = asyncio.run(scenario())
    assert "lost before streaming" not in results
    assert results.count("ok") >= len(results) // 2, results
    assert holder not in router.curr_replicas      # known dead: never offered again
    assert sum(h > 0 for _, h in after) >= 2       # one recomputes the prefix, the others start from it
    if client.retried == 0:   # a race of the kill with the engine: the dead replica had no queued request left
        pytest.skip(f"the kill found no queued request on the dead replica ({results.count('ok')} ok): "
                    "the retry path was not exercised this run")
    print(f"kill: {results.count('ok')} ok, {results.count('lost while streaming')} lost while streaming, "
          f"{client.retried} sent again")
