"""Issue 12: the event loop never waits on the engine. The engine steps on its own thread behind a queue;
/health (and any coroutine) keeps answering while a 64-candidate score and a 4k-token prefill run, and a
request the engine fails gets its error while the others complete."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from gdnserve.engine.async_engine import AsyncEngine
from gdnserve.engine.engine_api import GenerateRequest
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import load_engine
from gdnserve.entrypoints.server import build_app


@pytest.fixture(scope="module")
def engine():
    return AsyncEngine(load_engine(device="cpu", max_num_seqs=80, num_pages=1024))


async def collect(eng, rid, prompt, params):
    last = None
    async for out in eng.generate(GenerateRequest(rid, prompt, params)):
        last = out
    return last


def test_health_answers_while_score_and_long_prefill_run(engine):
    rng = random.Random(0)
    prefix = [rng.randrange(3, 250) for _ in range(200)]
    cands = [[rng.randrange(3, 250) for _ in range(rng.randint(8, 24))] for _ in range(64)]
    long_prompt = [rng.randrange(3, 250) for _ in range(4000)]
    app = build_app(engine)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:  # a loopback Host
            work = asyncio.gather(engine.score(prefix, cands),
                                  collect(engine, "long", long_prompt, SamplingParams(temperature=0.0, max_tokens=2)))
            task = asyncio.ensure_future(work)
            lat = []
            while not task.done():
                t = time.perf_counter()
                r = await client.get("/health")
                lat.append(time.perf_counter() - t)
                assert r.status_code == 200
                await asyncio.sleep(0.01)
            score, long = await task
            return lat, score, long
    lat, score, long = asyncio.run(main())
    assert len(score.candidates) == 64 and long.finished and len(long.outputs[0].token_ids) == 2
    lat.sort()
    assert len(lat) >= 5                                  # the work took a while; /health kept answering
    assert lat[int(0.99 * (len(lat) - 1))] <= 0.25, lat[-5:]


def test_bad_input_is_a_value_error_and_a_failed_request_fails_alone(engine):
    e = engine.engine
    real = e.runner.step

    def step(prefills, decodes, **kw):
        if any(258 == t for it in prefills for t in it.tokens[:1]):
            raise RuntimeError("injected")
        return real(prefills, decodes, **kw)

    async def main():
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, "oov", [1, 2, 10 ** 7], SamplingParams(max_tokens=1))
        e.runner.step = step
        try:
            g = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            res = await asyncio.gather(*[collect(engine, f"ok{i}", [5 + i, 6, 7], g) for i in range(4)],
                                       collect(engine, "boom", [258, 1, 2], g), return_exceptions=True)
        finally:
            e.runner.step = real
        return res
    res = asyncio.run(main())
    assert isinstance(res[-1], RuntimeError) and "injected" in str(res[-1])
    assert all(r.finished and len(r.outputs[0].token_ids) == 4 for r in res[:-1])
    st = engine.stats()
    assert {"queue_depth", "running", "state_pool_used", "page_pool_used", "requests_failed"} <= set(st)
