"""A /v1/score whose client goes away: the engine's score job is aborted (its waves, its prefix producer and its
checkpoint references) and the engine goes idle long before the job could have finished, with nothing left behind
but READY checkpoints. On the real embedded engine behind ``AsyncEngine``, served by uvicorn on loopback."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

httpx = pytest.importorskip("httpx")

from gdnserve.engine.async_engine import AsyncEngine  # noqa: E402
from gdnserve.entrypoints.llm import load_engine  # noqa: E402
from tests.entrypoints.fake_engine import Served, wait_for  # noqa: E402

# a small step budget: a 1024-candidate job takes ~200 steps (a 256-candidate one finished within the 1.5 s on an
# idle CPU once score prefixes kept their step share), one step a fraction of a second.
# What is asserted is that the work stops once the client is gone (at most a few steps' tokens after it), not how
# much was done before: that depends on the machine's speed (a busy 2-core CI machine, a faster scheduler).
N_CANDS, CAND_LEN, STEP_TOKENS = 1024, 12, 64
AFTER_GONE = 5 * STEP_TOKENS    # the step in flight and the few that start before the abort reaches the engine


@pytest.fixture(scope="module")
def engine():
    return AsyncEngine(load_engine(device="cpu", max_num_seqs=8, num_pages=512, max_step_tokens=STEP_TOKENS))


def big_job(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    return ([rng.randrange(3, 250) for _ in range(40)],
            [[rng.randrange(3, 250) for _ in range(CAND_LEN)] for _ in range(N_CANDS)])


def assert_clean(engine: AsyncEngine) -> None:
    """Idle, no job or result held, every state slot and KV page held by a READY checkpoint only."""
    e = engine.engine
    st = engine.stats()
    assert st["running"] == st["queue_depth"] == 0, st
    assert not e.requests and not e.scores and not e.scheduler.producing and not engine._futures
    assert st["state_pool_used"] == st["checkpoints_ready"], st
    held = {p for pt in e.kv.checkpoint_cache.pages.values() for p in pt.pages}
    assert st["page_pool_used"] == len(held), st
    assert all(c.refcount == 0 for c in e.index._entries.values())
    assert e.index.check_integrity() == [] and e.kv.pages.check_integrity() == []


def test_disconnect_aborts_the_score_job(engine):
    prefix, cands = big_job(0)
    tokens_before = engine.stats()["prompt_tokens"]
    served = Served(engine)
    try:
        with httpx.Client(base_url=served.url, timeout=1.5) as c:
            with pytest.raises(httpx.ReadTimeout):       # the client gives up and closes the connection
                c.post("/v1/score", json={"prefix": prefix, "candidates": cands})
        gone, at_gone = time.monotonic(), engine.stats()["prompt_tokens"]
        assert wait_for(lambda: engine.stats()["running"] == engine.stats()["queue_depth"] == 0
                        and not engine.engine.requests, timeout=20), "the score job kept running"
        print(f"idle {time.monotonic() - gone:.1f} s after the disconnect")
        done, after = engine.stats()["prompt_tokens"] - tokens_before, engine.stats()["prompt_tokens"] - at_gone
        assert done < N_CANDS * CAND_LEN and after <= AFTER_GONE, (
            f"{done} of {N_CANDS * CAND_LEN} candidate tokens computed, {after} after the client left")
        assert_clean(engine)
    finally:
        served.stop()


def test_cancelled_score_call_aborts_the_job(engine):
    """The same below the server: cancelling ``AsyncEngine.score`` (what a disconnect does) aborts the job."""
    prefix, cands = big_job(1)
    tokens_before = engine.stats()["prompt_tokens"]

    async def main() -> int:
        task = asyncio.ensure_future(engine.score(prefix, cands))
        await asyncio.sleep(1.0)
        at_cancel = engine.stats()["prompt_tokens"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return at_cancel
    at_cancel = asyncio.run(main())
    assert wait_for(lambda: engine.stats()["running"] == engine.stats()["queue_depth"] == 0
                    and not engine.engine.requests, timeout=20), "the score job kept running"
    assert engine.stats()["prompt_tokens"] - tokens_before < N_CANDS * CAND_LEN
    assert engine.stats()["prompt_tokens"] - at_cancel <= AFTER_GONE
    assert_clean(engine)
