"""`gdnserve serve --tensor-parallel-size 2` on CPU (two processes over gloo, the embedded model) gives TP=1's
greedy outputs and logprobs (1e-5, fp32) through the real server: plain prompts, a checkpoint group (marker),
n = 2, /v1/score and speculative decoding (ngram); then a worker killed mid-stream fails the open request with
the worker's exit in the message, and the server exits 1 (bounded waits: nothing may hang). A size that does
not divide the model's heads is refused by `serve` and `generate` before any process starts."""
from __future__ import annotations

import os
import signal

import pytest

httpx = pytest.importorskip("httpx")
from tests.entrypoints.live_server import start_server  # noqa: E402  (needs httpx)

MARK = "<|state_checkpoint|>"
PREFIX = "Shared context for ranking: gdnserve computes a prefix once and forks it. "
PROMPTS = ["Hello there", PREFIX + MARK + " candidate one", PREFIX + MARK + " candidate two",
           "abc abc abc abc abc abc abc"]           # repetitive: the n-gram drafter's drafts get accepted
ENGINE = dict(spec_k=2, max_num_seqs=8, num_pages=256)
TOL = 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tp_serve") / "serve.log"
    proc, url, log = start_server(["--tensor-parallel-size", "2", "--spec-k", "2", "--max-num-seqs", "8",
                                   "--num-pages", "256"], log_path)
    yield url, proc, log_path
    if proc.poll() is None:
        proc.terminate()
        proc.wait(20)
    log.close()


@pytest.fixture(scope="module")
def reference():
    from gdnserve.entrypoints.llm import LLM
    # on the server's device (start_server passes --device cpu): on a GPU machine the default would put the
    # reference on CUDA in bf16, 5.8e-4 from the CPU server's fp32 logprobs (H200 at 00ae8ae)
    return LLM(device="cpu", cuda_graphs=False, **ENGINE)


def test_tp2_server_equals_tp1(server, reference):
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.entrypoints.protocol import completion_logprobs
    url, _, _ = server
    k = 3
    r = httpx.post(url + "/v1/completions", json={"model": "gdnserve-embedded", "prompt": PROMPTS, "max_tokens": 10,
                                                 "temperature": 0, "logprobs": k}, timeout=120)
    assert r.status_code == 200, r.text
    got = sorted(r.json()["choices"], key=lambda c: c["index"])
    ref = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, logprobs=k))
    assert r.json()["gdnserve"]["prompts"][1]["published"]        # the marker made a checkpoint group
    for c, o in zip(got, ref):
        s = o.outputs[0]
        assert c["text"] == s.text
        lp, want = c["logprobs"], completion_logprobs(reference.engine.tokenizer, s.token_ids, s.logprobs, k)
        assert lp["tokens"] == want["tokens"]
        for a, b in zip(lp["token_logprobs"], want["token_logprobs"]):
            assert abs(a - b) <= TOL
        for a, b in zip(lp["top_logprobs"], want["top_logprobs"]):    # keyed by token text, as the server does
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) <= TOL
    # without logprobs the same prompts decode speculatively (k = 2 n-gram drafts verified per step)
    before = reference.engine.counts.spec_accepted
    r = httpx.post(url + "/v1/completions", json={"model": "gdnserve-embedded", "prompt": PROMPTS, "max_tokens": 12,
                                                 "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    ref = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert reference.engine.counts.spec_accepted > before     # the workload verifies and accepts drafts
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == [o.outputs[0].text
                                                                                       for o in ref]
    # n = 2: samples fork from the prompt and decode without drafts
    r = httpx.post(url + "/v1/completions", json={"model": "gdnserve-embedded", "prompt": "Hello", "n": 2,
                                                 "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    want = reference.generate("Hello", SamplingParams(temperature=0, max_tokens=6, n=2))[0]
    assert sorted(c["text"] for c in r.json()["choices"]) == sorted(s.text for s in want.outputs)
    # /v1/score: the prefix once, the candidates as its consumers
    labels = [121, 110]
    r = httpx.post(url + "/v1/score", json={"prefix": PREFIX, "candidates": [" yes", " no", " maybe so"],
                                           "label_token_ids": labels}, timeout=60)
    assert r.status_code == 200, r.text
    sc = reference.score(PREFIX, [" yes", " no", " maybe so"], labels)
    for d, c in zip(sorted(r.json()["data"], key=lambda d: d["index"]), sc.candidates):
        assert abs(d["sum_logprob"] - c.sum_logprob) <= TOL and abs(d["mean_logprob"] - c.mean_logprob) <= TOL


def _worker_pid(server_pid: int) -> int:
    """The spawned tensor-parallel worker among the server's children (not multiprocessing's resource tracker)."""
    kids = [int(c) for t in os.listdir(f"/proc/{server_pid}/task")
            for c in open(f"/proc/{server_pid}/task/{t}/children").read().split()]
    workers = [c for c in kids if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(workers) == 1, kids
    return workers[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the worker through /proc")
def test_killed_worker_fails_the_stream_and_the_server_exits_1(server):
    url, proc, log_path = server
    body = {"model": "gdnserve-embedded", "prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            events.append(line)
            if len(events) == 3:                  # the stream is running: kill rank 1 under it
                os.kill(_worker_pid(proc.pid), signal.SIGKILL)
    text = "\n".join(events)
    assert "tensor-parallel worker rank 1 exited with signal SIGKILL" in text, text[-2000:]
    assert proc.wait(60) == 1
    assert "the engine stopped: tensor-parallel worker rank 1 exited with signal SIGKILL" in log_path.read_text()


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts(capsys):
    from gdnserve import cli
    msg = "tensor_parallel_size = 4 does not divide the model: config linear_num_key_heads = 2 is not divisible by 4"
    assert cli.main(["generate", "hi", "--device", "cpu", "--tensor-parallel-size", "4"]) == 2
    assert msg in capsys.readouterr().err
    assert cli.main(["serve", "--device", "cpu", "--port", "0", "--tensor-parallel-size", "4"]) == 1
    assert f"cannot load the embedded model: {msg}" in capsys.readouterr().err
    assert cli.main(["serve", "--replicas", "2", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size with --replicas is not supported yet" in capsys.readouterr().err
