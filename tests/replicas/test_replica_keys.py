"""The router's keys are the engine's: a marked request's route names the checkpoint the engine stores for it,
a finished request's published key is its automatic checkpoint, a score's route its prefix checkpoint; the
stats merge of the ingress; the application builder's argument checks. No Ray cluster."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.replicas.keys import generate_route, prefix_key, published_key, score_route


@pytest.fixture(scope="module")
def engine():
    from gdnserve.entrypoints.llm import load_engine
    return load_engine(None, device="cpu", max_num_seqs=8, num_pages=256, max_model_len=256)


def _finish(engine, req):
    rid = engine.submit(req)
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
    return final


def test_routes_name_the_checkpoints_the_engine_stores(engine, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 200) for _ in range(rng.randint(17, 41))]
    prompt = prefix + [rng.randrange(1, 200) for _ in range(rng.randint(2, 7))]
    out = _finish(engine, engine.make_request(None, prompt, SamplingParams(max_tokens=3, temperature=0.0), len(prefix)))
    ready, pending, lengths = engine.index.keys()
    route = generate_route(prompt, len(prefix))
    assert route.exact in ready and not pending
    key, length = published_key(prompt, out.outputs[0].token_ids)
    assert key in ready and length in lengths
    # the next turn (no marker) finds that automatic checkpoint at one of the reported lengths
    turn = generate_route(prompt + out.outputs[0].token_ids + [7, 8], None)
    assert turn.exact is None and prefix_key(turn.prompt, length) in ready
    # a score prefix: the checkpoint of the prefix minus its last token
    sp = [rng.randrange(1, 200) for _ in range(rng.randint(9, 23))]
    engine.score(sp, [[3, 4], [5]])
    assert score_route(sp).exact in engine.index.keys()[0]
    assert score_route(sp[:1]).exact is None


def test_merge_stats_sums_numbers_and_reasons():
    pytest.importorskip("ray")
    from gdnserve.replicas.client import merge_stats
    a = {"running": 2, "checkpoint_hits": 5, "checkpoint_misses": {"absent": 1}, "name": "x", "flag": True}
    b = {"running": 1, "checkpoint_hits": 4, "checkpoint_misses": {"absent": 2, "evicted": 1}}
    assert merge_stats([a, b]) == {"running": 3, "checkpoint_hits": 9, "checkpoint_misses": {"absent": 3, "evicted": 1}}
    assert merge_stats([]) == {}


def test_build_app_checks_its_arguments():
    pytest.importorskip("ray.serve")
    from gdnserve.replicas.app import build_app
    with pytest.raises(ValueError, match="unknown argument"):
        build_app({"replica": "2"})
    with pytest.raises(ValueError, match="replicas must be"):
        build_app({"replicas": "0"})
    with pytest.raises(ValueError, match="router must be"):
        build_app({"router": "round_robin"})
    assert build_app({"replicas": "3", "max_num_seqs": "8", "api_key": "k"}) is not None
