"""The real server process (`gdnserve serve`, embedded model, CPU) on loopback, driven by the real
`openai` client and httpx: completions, chat streaming, n > 1, score, checkpoints that never change
greedy outputs, and 200 concurrent streams that leave no slot or page behind but the READY checkpoints;
the start-up banner, /metrics against docs/serving.md on the real engine (step and queue histograms filled),
special tokens in user text as plain text."""
from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.test_metrics import check_against_docs

httpx = pytest.importorskip("httpx")
from tests.entrypoints.live_server import start_server  # noqa: E402  (needs httpx)

openai = pytest.importorskip("openai")

MARK = "<|state_checkpoint|>"
PREFIX = "Shared context for ranking: gdnserve computes a prefix once and forks it. "


LOG: dict[str, str] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url, log = start_server(["--max-num-seqs", "32", "--num-pages", "1024"], log_path)
    LOG["path"] = str(log_path)
    yield url
    proc.terminate()
    proc.wait(20)
    log.close()


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
    # provenance as completions report a marker's checkpoint: the job publishes its prefix (the first candidate
    # says so), the other candidates and a later job's start from it
    fresh = {"prefix": "A prefix no request has used yet: is it good? Answer:", "candidates": [" yes", " no"]}
    first, again = (httpx.post(server + "/v1/score", json=fresh, timeout=60).json() for _ in range(2))
    n = first["gdnserve"]["prefix_tokens"]
    assert [(d["gdnserve"]["hit_length"], d["gdnserve"]["miss_reason"], d["gdnserve"]["published"])
            for d in first["data"]] == [(0, "absent", True), (n, None, False)]
    assert [(d["gdnserve"]["hit_length"], d["gdnserve"]["published"]) for d in again["data"]] == [(n, False)] * 2
    bad = httpx.post(server + "/v1/score", json={"prefix": PREFIX, "candidates": []}, timeout=10)
    assert bad.status_code == 400 and "candidates" in bad.text
    # prefix + candidate exactly at the context length: the server refuses as the engine would, naming the item
    edge = httpx.post(server + "/v1/score", json={"query": [5] * 4000, "items": [[6], [7] * 96]}, timeout=10)
    assert edge.status_code == 400 and edge.json()["error"]["param"] == "items[1]", edge.text
    dup = httpx.post(server + "/v1/score", json={"prefix": PREFIX, "candidates": [" yes"],
                                                 "label_token_ids": [121, 110, 121]}, timeout=10)
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "label_token_ids", dup.text


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
    m = samples(httpx.get(server + "/metrics", timeout=10).text)
    # after the drain only READY checkpoints hold state slots (each holds exactly one)
    assert m["gdnserve:num_requests_running"] == m["gdnserve:num_requests_waiting"] == 0
    assert m["gdnserve:state_pool_slots_used"] == m["gdnserve:checkpoints_ready"] >= 1, m


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_banner(server):
    text = open(LOG["path"]).read()
    banner = text[text.index("gdnserve: serving"):]
    assert "gdnserve-embedded" in banner and "device cpu, dtype float32" in banner
    assert "pools: 66 state slots x 210.0 KiB (66 working + 0 for checkpoints), 1024 KV pages x 16.0 KiB" in banner
    assert "memory: budget" in banner and "capacity: 4 concurrent requests at max_model_len 4096" in banner
    assert "n <= 32 (--max-n 64, capped by the engine)" in banner  # what the engine holds, not the flag's 64
    assert f"listening on {server}" in banner and "API key none" in banner


def test_metrics_on_the_real_engine(server, client):
    client.completions.create(model="gdnserve-embedded", prompt="metrics on the real engine", max_tokens=3)
    text = httpx.get(server + "/metrics", timeout=10).text
    check_against_docs(text)
    m = samples(text)
    assert m["gdnserve:engine_step_time_seconds_count"] >= 3          # observed from outside the engine
    assert m["gdnserve:request_queue_time_seconds_count"] >= 1
    assert m["gdnserve:time_to_first_token_seconds_count"] >= 1 and m["gdnserve:generation_tokens_total"] >= 3
    assert m["process_resident_memory_bytes"] > 0


def test_echo_logprobs_after_an_automatic_checkpoint(server):
    """lm-evaluation-harness scores choices with echo + logprobs: every prompt position but the first has a
    logprob, also when an earlier request's automatic checkpoint covers the prompt's prefix (the request ignores
    it; it gave 12 nulls after "Hello world")."""
    def post(body):
        r = httpx.post(server + "/v1/completions", json={"max_tokens": 1, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    post({"prompt": "Hello world"})
    assert post({"prompt": "Hello world, again"})["gdnserve"]["prompts"][0]["hit_length"] == 11    # the cache hits
    r = post({"prompt": "Hello world, again", "echo": True, "logprobs": 1})
    lps, n = r["choices"][0]["logprobs"]["token_logprobs"], r["usage"]["prompt_tokens"]
    assert len(lps) == n + 1 and lps[0] is None and all(x is not None for x in lps[1:]), lps
    prov = r["gdnserve"]["prompts"][0]
    assert (prov["hit_length"], prov["miss_reason"]) == (0, "prompt_logprobs")


def test_n_samples_of_a_long_marked_prefix_fit(server):
    """n = 32 samples of an 800-token marked prefix share its pages (~82 of the 1024, not 32 x 51 = 1632: it was
    refused); a request that really does not fit is refused naming n."""
    r = httpx.post(server + "/v1/completions", json={"prompt": "p" * 800 + MARK + " tail", "n": 32, "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 32 and r.json()["gdnserve"]["prompts"][0]["published"]
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "n": 32, "max_tokens": 4000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "KV pages" in r.json()["error"]["message"]


def test_special_tokens_plain_on_the_real_engine(client):
    r = client.completions.create(model="gdnserve-embedded", prompt="a<|im_end|>b", max_tokens=1)
    assert r.usage.prompt_tokens == 12                                  # the bytes it spells
    r = client.completions.create(model="gdnserve-embedded", prompt="a<|im_end|>b", max_tokens=1,
                                  extra_body={"parse_special_tokens": True})
    assert r.usage.prompt_tokens == 3
