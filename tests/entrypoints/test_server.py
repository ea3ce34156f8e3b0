"""The HTTP server, end to end on loopback: the real uvicorn server in a thread, driven by the real
``openai`` client and httpx, over the fake engine of ``fake_engine.py`` (deterministic outputs)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

# test-only dependencies (the [test] extra); a machine without them skips this file with the reason
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from gdnserve.engine.engine_api import AsyncEngineClient
from gdnserve.entrypoints.server import OFF_LOOP_AT
from gdnserve.models.tokenizer import DEFAULT_MARKER
from tests.entrypoints.fake_engine import MAX_LEN, MODEL, TOK, FakeEngine, Served, chat_prompt, expected, wait_for


@pytest.fixture(scope="module")
def served():
    s = Served(FakeEngine())
    yield s
    s.stop()


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=10) as c:
        yield c


# ---- the openai client -------------------------------------------------------------------------------

def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=7)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert [c.text for c in r.choices] == [expected("hello world", 7)]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 7, 18)
    prov = r.model_extra["gdnserve"]["prompts"][0]
    assert prov["prompt_tokens"] == 11 and prov["hit_length"] == 0 and prov["miss_reason"] == "absent"


def test_completion_n_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="abcdefg", max_tokens=5, n=3, logprobs=2, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [expected("abcdefg", 5, j) for j in range(3)]
    lp = r.choices[1].logprobs
    assert lp.tokens == list("bcdef")
    assert lp.token_logprobs == pytest.approx([-0.5 - 0.01 * s for s in range(5)])
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.top_logprobs[0]["b"] == pytest.approx(-0.5)
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert r.usage.completion_tokens == 15


def test_completion_echo_stop_and_many_prompts(client):
    r = client.completions.create(model=MODEL, prompt="xyz", max_tokens=4, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == "xyz" + expected("xyz", 4)
    assert c.logprobs.tokens == list("xyzxyzx") and c.logprobs.token_logprobs[0] is None
    r = client.completions.create(model=MODEL, prompt="abcdef", max_tokens=10, stop=["d"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("abc", "stop")
    r = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=3, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "aba"), (1, "bab"), (2, "cdc"), (3, "dcd")]
    assert [p["index"] for p in r.model_extra["gdnserve"]["prompts"]] == [0, 1]
    r = client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=3)  # token ids
    assert r.choices[0].text == "hih"


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=9, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks[:-1]:
        assert ch.object == "text_completion" and ch.usage is None and len(ch.choices) == 1
        texts[ch.choices[0].index] += ch.choices[0].text
        if ch.choices[0].finish_reason:
            finish[ch.choices[0].index] = ch.choices[0].finish_reason
            # provenance at the chunk's top level, where the non-streamed response has it
            assert ch.model_extra["gdnserve"]["prompts"][0]["prompt_tokens"] == 9
            assert "gdnserve" not in ch.choices[0].model_extra
        else:
            assert "gdnserve" not in ch.model_extra
    assert texts == {j: expected("stream me", 9, j) for j in range(2)}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_responses_formatted_off_the_event_loop(client):
    # 2 choices x (200 echoed + 3 tokens) x (1 + 20 logprobs) token entries, the first stream chunks 2 x 201 x 21:
    # past OFF_LOOP_AT, so formatted and serialised in a worker thread; the same content either way
    assert 2 * 201 * 21 > OFF_LOOP_AT
    prompt = "off the loop " * 15 + "abcde"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=3, n=2, echo=True, logprobs=20)
    r = client.completions.create(**kw)
    assert [c.text for c in r.choices] == [prompt + expected(prompt, 3, j) for j in range(2)]
    assert [len(c.logprobs.tokens) for c in r.choices] == [203, 203]
    assert len(r.choices[1].logprobs.top_logprobs[-1]) == 20
    text, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for ch in client.completions.create(**kw, stream=True):
        c = ch.choices[0]
        text[c.index] += c.text
        tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert text == {j: r.choices[j].text for j in range(2)}
    assert tokens == {j: r.choices[j].logprobs.tokens for j in range(2)}


def test_chat(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True, top_logprobs=3)
    prompt = TOK.apply_chat_template(msgs)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected(prompt, 12)
    content = r.choices[0].logprobs.content
    assert len(content) == 12 and len(content[0].top_logprobs) == 3
    assert content[0].token == content[0].top_logprobs[0].token and content[0].bytes == list(content[0].token.encode())
    assert r.usage.prompt_tokens == len(TOK.encode(prompt))


def test_chat_stream(client):
    msgs = [{"role": "user", "content": "tell me"}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, n=2, stream=True)
    text, roles, finish = {0: "", 1: ""}, {}, {}
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        d = ch.choices[0]
        roles.setdefault(d.index, d.delta.role)
        text[d.index] += d.delta.content or ""
        if d.finish_reason:
            finish[d.index] = d.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and finish == {0: "length", 1: "length"}
    assert text == {j: expected(chat_prompt("tell me"), 10, j) for j in range(2)}


def test_checkpoint_provenance(client):
    shared = "a shared system prompt, "
    first = client.completions.create(model=MODEL, prompt=shared + DEFAULT_MARKER + "question one", max_tokens=2)
    p = first.model_extra["gdnserve"]["prompts"][0]
    assert (p["checkpoint_at"], p["published"], p["hit_length"], p["miss_reason"]) == (len(shared), True, 0, "absent")
    second = client.completions.create(model=MODEL, prompt=shared + "question two", max_tokens=2)
    p = second.model_extra["gdnserve"]["prompts"][0]
    assert (p["hit_length"], p["miss_reason"], p["published"]) == (len(shared), None, False)
    # an explicit offset instead of the marker; echo leaves the marker out
    r = client.completions.create(model=MODEL, prompt="0123456789", max_tokens=1, echo=True,
                                  extra_body={"checkpoint_at": 4})
    assert r.choices[0].text == "01234567890" and r.model_extra["gdnserve"]["prompts"][0]["checkpoint_at"] == 4


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert "gpt-4" in e.value.body["message"]


# ---- httpx: score, metrics, health ------------------------------------------------------------------

def test_score(http, served):
    body = {"model": MODEL, "query": "Which is right? ", "items": ["yes", "no", "maybe"],
            "label_token_ids": [ord("Y"), ord("N")], "apply_softmax": True}
    r = http.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["gdnserve"]["prefix_tokens"] == 16 and len(out["data"]) == 3
    for s in out["scores"]:
        assert sum(s) == pytest.approx(1.0)
    d = out["data"][1]
    assert d["num_tokens"] == 2 and d["sum_logprob"] == pytest.approx(sum(-0.1 * (1 + t % 7) for t in b"no"))
    assert d["mean_logprob"] == pytest.approx(d["sum_logprob"] / 2)
    assert set(d["label_probs"]) == {str(ord("Y")), str(ord("N"))}
    assert [x["gdnserve"]["published"] for x in out["data"]] == [True, False, False]
    assert [x["gdnserve"]["hit_length"] for x in out["data"]] == [0, 16, 16]
    raw = http.post("/v1/score", json={"prefix": [1, 2, 3], "candidates": [[4], [5, 6]],
                                       "label_token_ids": [7]}).json()
    assert raw["scores"] == [[pytest.approx(0.1)], [pytest.approx(0.15)]]  # no softmax: raw probabilities
    plain = http.post("/v1/score", json={"prefix": "p", "candidates": ["a"]}).json()
    assert plain["scores"] is None and plain["data"][0]["label_probs"] is None


def test_health_and_metrics(http, client):
    assert http.get("/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert fams["gdnserve:generation_tokens"].type == "counter"
    assert fams["gdnserve:num_requests_waiting"].type == "gauge"
    assert fams["gdnserve:time_to_first_token_seconds"].type == "histogram"
    misses = {s.labels["reason"]: s.value for s in fams["gdnserve:checkpoint_misses"].samples}
    assert misses["absent"] >= 1
    usage = fams["gdnserve:kv_cache_usage_perc"].samples[0].value
    assert usage == pytest.approx(3 / 128)
    count = next(s.value for s in fams["gdnserve:time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert count >= 1


# ---- bad input: a 4xx naming the field ----------------------------------------------------------------

C, CH, S = "/v1/completions", "/v1/chat/completions", "/v1/score"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["ok", ""]}, 400, "prompt"),
    (CH, {"messages": []}, 400, "messages"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (CH, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (C, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (CH, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "n": 65}, 400, "n"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    (S, {"model": "no-such-model", "prefix": "a", "candidates": ["b"]}, 404, "model"),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"max_tokens": 3}, 400, "prompt"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (C, {"prompt": [1, 2, 999]}, 400, "prompt"),
    (S, {"prefix": "a", "candidates": ["b"], "label_token_ids": [260]}, 400, "label_token_ids"),
    (S, {"prefix": "a", "candidates": ["b"], "label_token_ids": [-1]}, 400, "label_token_ids"),
    (S, {"prefix": "a", "candidates": ["b"], "label_token_ids": ["yes"]}, 400, "label_token_ids[0]"),
    (S, {"prefix": "a", "candidates": []}, 400, "candidates"),
    (S, {"query": "a", "items": ["b", ""]}, 400, "items[1]"),
    (S, {"candidates": ["b"]}, 400, "prefix"),
    (S, {"prefix": "a", "query": "a", "candidates": ["b"]}, 400, "prefix"),
    (S, {"prefix": "a" * 250, "candidates": ["b" * 10]}, 400, "candidates[0]"),
    (S, {"prefix": "a" * 250, "candidates": ["b" * 6]}, 400, "candidates[0]"),      # exactly the context: no room
    (S, {"query": "a" * 250, "items": ["b", "b" * 6]}, 400, "items[1]"),            # for the next token
    (S, {"prefix": "a", "candidates": ["b"], "label_token_ids": [5, 7, 5]}, 400, "label_token_ids"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content[1].type"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    (C, {"prompt": "a" * (MAX_LEN + 5)}, 400, "prompt"),
    (CH, {"messages": [{"role": "user", "content": "a" * MAX_LEN}]}, 400, "messages"),
    (C, {"prompt": "a" * 100, "max_tokens": 200}, 400, "max_tokens"),
    (C, {"prompt": f"a{DEFAULT_MARKER}b{DEFAULT_MARKER}c"}, 400, "prompt"),
    (C, {"prompt": f"{DEFAULT_MARKER}abc"}, 400, "prompt"),
    (C, {"prompt": f"abc{DEFAULT_MARKER}"}, 400, "prompt"),
    (CH, {"messages": [{"role": "user", "content": f"a{DEFAULT_MARKER}b{DEFAULT_MARKER}"}]}, 400, "messages"),
    (C, {"prompt": f"ab{DEFAULT_MARKER}cd", "checkpoint_at": 1}, 400, "checkpoint_at"),
    (C, {"prompt": "abcd", "checkpoint_at": 4}, 400, "checkpoint_at"),
    (C, {"prompt": "abcd", "checkpoint_at": 0}, 400, "checkpoint_at"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {"prompt": "BADVALUE"}, 400, None),  # the engine's own ValueError
    (S, {"prefix": "BADVALUE", "candidates": ["b"]}, 400, None),
]


def check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"] or status == 404


@pytest.mark.parametrize("stream,path,body,status,param",
                         [(st, *b) for b in BAD for st in (False, True) if not (st and b[0] == S)],
                         ids=[f"{i}-{b[-1]}-{'stream' if st else 'json'}" for i, b in enumerate(BAD)
                              for st in (False, True) if not (st and b[0] == S)])
def test_bad_input(http, path, body, status, param, stream):
    if "messages" not in body and path == CH:
        body = {**body, "messages": MSG}
    r = http.post(path, json={**body, "stream": stream} if "stream" not in body else body)
    check_error(r, status, param)
    if status == 404:
        assert body["model"] in r.json()["error"]["message"]


def test_malformed_json(http):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = http.post(C, content=raw, headers={"content-type": "application/json"})
        check_error(r, 400, None)
        assert "JSON" in r.json()["error"]["message"]


def test_unknown_route_is_json(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# ---- failures, disconnects, load ----------------------------------------------------------------------

def test_sse_wire_format(http):
    with http.stream("POST", CH, json={"messages": MSG, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]


def test_engine_failure_stays_in_its_request(http, client, served):
    r = http.post(C, json={"prompt": "RAISE please", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with http.stream("POST", C, json={"prompt": "RAISE please", "max_tokens": 5, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert "error" in json.loads(events[-2][6:]) and len(events) == 4  # two tokens, the error, [DONE]
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=3).choices[0].text == "fin"
    r = http.post(C, json={"prompt": "ENDEARLY", "max_tokens": 5})
    assert r.status_code == 500 and "without a finished output" in r.json()["error"]["message"]
    engine = served.engine
    engine.fail_score = True
    try:
        r = http.post(S, json={"prefix": "a", "candidates": ["b"]})
    finally:
        engine.fail_score = False
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert http.post(S, json={"prefix": "a", "candidates": ["b"]}).status_code == 200


def test_streaming_disconnect_aborts(served):
    engine = served.engine
    with httpx.Client(base_url=served.url, timeout=10) as c:
        with c.stream("POST", C, json={"prompt": "SLOW stream", "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            rid = json.loads(first[6:])["id"]
    assert wait_for(lambda: f"{rid}-0" in engine.aborted), "disconnect did not abort the request"
    assert wait_for(lambda: f"{rid}-0" not in engine.active)


def test_non_streaming_disconnect_aborts(served):
    engine = served.engine
    before = len(engine.seen)
    with httpx.Client(base_url=served.url, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(C, json={"prompt": "SLOW and silent", "max_tokens": 200})
    rid = engine.seen[before].request_id
    assert wait_for(lambda: rid in engine.aborted), "disconnect did not abort the request"


def test_aborted_requests_count_in_request_success(served, http):
    """A client that goes away: its samples count under request_success_total{finished_reason="abort"} (the
    documented series never appeared), streamed or not; the series is exported from the start."""
    def aborts() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        return next(s.value for s in fams["gdnserve:request_success"].samples
                    if s.labels.get("finished_reason") == "abort")
    before = aborts()
    with httpx.Client(base_url=served.url, timeout=10) as c:
        with c.stream("POST", C, json={"prompt": "SLOW stream", "max_tokens": 200, "n": 2, "stream": True}) as r:
            next(line for line in r.iter_lines() if line)
    assert wait_for(lambda: aborts() == before + 2), aborts()
    with httpx.Client(base_url=served.url, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(C, json={"prompt": "SLOW and silent", "max_tokens": 200})
    assert wait_for(lambda: aborts() == before + 3), aborts()
    http.post(C, json={"prompt": ["fine", "BADVALUE"], "max_tokens": 3})        # a 400: nothing counted
    assert aborts() == before + 3


def test_api_key():
    s = Served(FakeEngine(), api_key="sekret")
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = c.post(C, json={"prompt": "x"}, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models").status_code == 401
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 401  # issue 13
            assert c.get("/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="key", max_tokens=2).choices[0].text == "ke"
    finally:
        s.stop()


def test_fifty_concurrent_streams_with_bad_neighbours(served):
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        prompt = f"request number {i} "
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream])
        assert text == expected(prompt, 40), i
        return text

    async def bad(http: httpx.AsyncClient, i: int) -> int:
        path, body, status, param = BAD[i % len(BAD)]
        body = {**body, "messages": MSG} if path == CH and "messages" not in body else body
        r = await http.post(path, json=body)
        check_error(r, status, param)
        return r.status_code

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as client, \
                httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            results = await asyncio.gather(*[one(client, i) for i in range(50)],
                                           *[bad(http, i) for i in range(len(BAD))],
                                           http.post(C, json={"prompt": "RAISE now", "max_tokens": 5}))
            assert len([r for r in results[:50] if r]) == 50
            assert results[-1].status_code == 500

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 30
    assert wait_for(lambda: not served.engine.active), served.engine.active


def test_fake_engine_satisfies_protocol():
    assert isinstance(FakeEngine(), AsyncEngineClient)
