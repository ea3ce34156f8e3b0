"""GPU-only: the overlapped loop (EngineConfig.overlap, the default on CUDA) with CUDA graphs, on the embedded
model: decode steps replay their bucket's graph and prefill / mixed steps the mixed graphs, each with the decode
ids fed on the device (DecodeFeed written into the graph's static ids after the upload). Greedy outputs with
stop tokens, and seeded sampling with logprobs, equal the serial loop's; nothing leaks.
Run on the H200: ``python -m pytest -q tests/engine/test_overlap_gpu.py``."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

KW = {"device": "cuda", "dtype": "float32", "max_num_seqs": 8, "num_pages": 256, "max_step_tokens": 256}
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(_rng.randint(2, 90))] for _ in range(10)]


def run(e, params):
    ids = [e.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
    final = {}
    while e.has_unfinished():
        final.update({o.request_id: o for o in e.step() if o.finished})
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in final[r].outputs] for r in ids]


@pytest.fixture(scope="module")
def engines():
    """(serial, overlapped) engines, built once for the file (each captures its graphs: most of its time)."""
    return LLM(overlap=False, **KW).engine, LLM(overlap=True, **KW).engine


def test_overlap_with_graphs_equals_the_serial_loop(engines):
    serial, ov = engines
    assert ov.overlap and ov.runner.graphs is not None and ov.runner.graphs.mixed is not None
    free = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in PROMPTS]
    ref = run(serial, free)
    stops = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[r[0][0][2 + i % 5]])
             for i, r in enumerate(ref)]
    seeded = [SamplingParams(temperature=0.9, seed=i, n=1 + (i % 3 == 0), max_tokens=12, logprobs=2,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    for params in (free, stops, seeded):
        want, got = run(serial, params), run(ov, params)
        assert [[(t, f) for t, f, _ in o] for o in got] == [[(t, f) for t, f, _ in o] for o in want]
    st = ov.runner.graphs.stats
    assert st["replay"] > 0 and st["mixed_replay"] > 0, dict(st)
    for e in (serial, ov):
        assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
        e.evict_checkpoints(len(e.index))
        assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_overlapped_decode_steps_never_synchronise_the_host(engines):
    """In the steady decode phase the overlapped loop's one wait is the event of the step before (its sampled
    ids' copy): no synchronising CUDA call (``.item()``, ``.tolist()`` of a device tensor, a pageable copy) in
    the scheduling, the launch, the graph replay or the processing. ``torch.cuda.set_sync_debug_mode`` names the
    caller of each."""
    import warnings

    import torch
    _, ov = engines
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for p in PROMPTS[:4]:
        ov.add_request(None, p, sp)
    for _ in range(6):                       # prefills done, every request decoding
        ov.step()
    import traceback
    syncs: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):     # where our code called it: the innermost gdnserve frames
            ours = [f"{f.filename.split('gdnserve/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                    if "/gdnserve/" in f.filename]
            syncs.append(f"{message}; at " + " <- ".join(reversed(ours[-4:])))
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(12):
                ov.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while ov.has_unfinished():
        ov.step()
    assert not syncs, f"{len(syncs)} synchronising calls in 12 decode steps:\n" + "\n".join(dict.fromkeys(syncs))
