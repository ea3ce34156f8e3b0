"""The real server process (`gdnserve serve`, embedded model, CPU) on loopback, driven by the real
`openai` client and httpx: completions, chat streaming, n > 1, score, checkpoints that never change
greedy outputs, and 200 concurrent streams that leave no slot or page behind but the READY checkpoints."""
from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")

openai = pytest.importorskip("openai")

MARK = "<|state_checkpoint|>"
PREFIX = "Shared context for ranking: gdnserve computes a prefix once and forks it. "


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "gdnserve.entrypoints.cli", "serve", "--device", "cpu",
                             "--port", str(port), "--max-num-seqs", "32", "--num-pages", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start:\n" + proc.stdout.read().decode(errors="replace"))
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(20)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def greedy(client, prompt, n=1, max_tokens=8):
    r = client.completions.create(model="gdnserve-embedded", prompt=prompt, max_tokens=max_tokens, temperature=0, n=n)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r


def test_completion_chat_and_checkpoint_equivalence(client):
    plain, _ = greedy(client, PREFIX + "candidate one")
    marked, resp = greedy(client, PREFIX + MARK + "candidate one")
    assert marked == plain                                       # a checkpoint never changes the output
    extra = resp.model_extra.get("gdnserve")
    assert extra and extra["prompts"][0]["published"]
    two, _ = greedy(client, "Hello", n=2)
    assert two[0] == two[1] == greedy(client, "Hello")[0][0]
    chunks = list(client.chat.completions.create(model="gdnserve-embedded", stream=True, max_tokens=6, temperature=0,
                                                 messages=[{"role": "user", "content": "Say hi"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and isinstance(text, str)


def test_score_endpoint(server):
    r = httpx.post(server + "/v1/score", json={"prefix": PREFIX, "candidates": [" yes", " no"],
                                               "label_token_ids": [121, 110], "apply_softmax": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == 2 and abs(sum(body["scores"][0]) - 1) < 1e-5
    bad = httpx.post(server + "/v1/score", json={"prefix": PREFIX, "candidates": []}, timeout=10)
    assert bad.status_code == 400 and "candidates" in bad.text


def test_concurrent_streams_mixing_groups_and_plain_prompts(client, server):
    prompts = [PREFIX + MARK + f"candidate {i}" if i % 3 else f"plain prompt {i}" for i in range(200)]

    def run(p):
        s = client.completions.create(model="gdnserve-embedded", prompt=p, max_tokens=4, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in s if c.choices)

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(200) as pool:                     # 200 concurrent streaming requests
        streamed = list(pool.map(run, prompts))
    print(f"200 streams x 4 tokens in {time.monotonic() - t0:.1f} s")
    for p, got in zip(prompts[:6], streamed[:6]):
        assert got == greedy(client, p, max_tokens=4)[0][0]      # streaming == non-streaming, batched or not
    m = httpx.get(server + "/metrics", timeout=10).text
    def metric(name):
        return float(next(line for line in m.splitlines() if line.startswith(name + " ")).split()[-1])
    # after the drain only READY checkpoints hold state slots (each holds exactly one)
    assert metric("gdnserve_state_pool_used") == metric("gdnserve_checkpoints_ready") >= 1, m
