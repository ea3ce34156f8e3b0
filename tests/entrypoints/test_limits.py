"""Request limits (issue 13): each over-limit request gets its status (413 for the body, 400 otherwise) and an
OpenAI-style error naming the field; invalid Unicode anywhere is a 400; the nesting check agrees with a
parser on fresh random JSON; chat's max_tokens rules."""
from __future__ import annotations

import json
import random
import time

import pytest
from pydantic import ValidationError

# test-only dependencies (the [test] extra); a machine without them skips this file with the reason
httpx = pytest.importorskip("httpx")

from gdnserve.entrypoints.config import ServerConfig
from gdnserve.entrypoints.limits import Limits, invalid_unicode, json_depth, json_shape, may_hold_surrogates
from gdnserve.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, ScoreRequest, parse_request
from tests.entrypoints.fake_engine import MAX_LEN, FakeEngine, Served

LIM = Limits(max_body_bytes=20_000, max_prompts=5, max_stop=3, max_stop_chars=7, max_json_depth=6, max_candidates=4,
             max_n=3, max_logprobs=2, max_json_containers=20)
C, CH, S = "/v1/completions", "/v1/chat/completions", "/v1/score"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    s = Served(FakeEngine(), config=ServerConfig(limits=LIM, chat_default_max_tokens=40))
    yield s
    s.stop()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=20) as c:
        yield c


def error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    return err


OVER = [  # (path, body, param): one over each limit of LIM
    (C, {"prompt": ["p"] * 6}, "prompt"),
    (C, {"prompt": [[1, 2]] * 6}, "prompt"),
    (C, {"prompt": "x", "stop": ["a", "b", "c", "d"]}, "stop"),
    (C, {"prompt": "x", "stop": "12345678"}, "stop"),
    (CH, {"messages": MSG, "stop": ["ok", "12345678"]}, "stop"),
    (S, {"prefix": "a", "candidates": ["b"] * 5}, "candidates"),
    (S, {"query": "a", "items": ["b"] * 5}, "items"),
    (C, {"prompt": "x", "n": 4}, "n"),
    (C, {"prompt": "x", "logprobs": 3}, "logprobs"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", OVER, ids=[f"{i}-{o[2]}" for i, o in enumerate(OVER)])
def test_over_a_limit_is_a_400_naming_the_field(http, path, body, param):
    err = error(http.post(path, json=body), 400, param)
    assert param.split("[")[0] in err["message"]


def test_at_the_limits_is_fine(http):
    r = http.post(C, json={"prompt": ["ab"] * 5, "stop": ["a", "b", "1234567"], "n": 3, "logprobs": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 15
    assert http.post(S, json={"prefix": "a", "candidates": ["b"] * 4}).status_code == 200


def test_body_size_413(http):
    big = {"prompt": "x" * 20_001}
    err = error(http.post(C, json=big), 413, None, "request_too_large")
    assert "20000" in err["message"]

    def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"y" * 1000
        yield b'"}'
    r = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    error(r, 413, None, "request_too_large")
    assert http.post(C, json={"prompt": "x" * 100, "max_tokens": 1}).status_code == 200


def test_nesting_depth_400(http):
    err = error(http.post(C, content=b'{"prompt": ' + b"[" * 7 + b"1" + b"]" * 7 + b"}",
                          headers={"content-type": "application/json"}), 400, None, "json_too_deep")
    assert "6" in err["message"]
    # far past Python's recursion limit: still a 400, answered without parsing
    deep = b'{"prompt": ' + b"[" * 9_000 + b"]" * 9_000 + b"}"
    error(http.post(C, content=deep, headers={"content-type": "application/json"}), 400, None, "json_too_deep")
    # brackets inside strings do not count
    r = http.post(C, json={"prompt": "[[[[[[[[[[{{{{{{{{{{", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_number_too_long_for_int_is_a_400_naming_its_field(http):
    """An integer literal past Python's int conversion limit (4,300 digits) was a 500 (json.loads's ValueError):
    a 400 naming the field, or the body when the number is not a field's value."""
    hdr = {"content-type": "application/json"}
    err = error(http.post(C, content=b'{"prompt": "x", "max_tokens": ' + b"9" * 9_000 + b"}", headers=hdr), 400,
                "max_tokens", "number_too_long")
    assert "4300 digits" in err["message"]
    error(http.post(C, content=b'{"prompt": [1, ' + b"7" * 5_000 + b"]}", headers=hdr), 400, None, "number_too_long")
    assert http.post(C, json={"prompt": "x", "max_tokens": 1}).status_code == 200      # the server serves on


def test_too_many_arrays_and_objects_400(http):
    # counted before parsing: before the (later) check of the number of prompts
    err = error(http.post(C, json={"prompt": [[1]] * 20}), 400, None, "json_too_many_containers")
    assert "22" in err["message"] and "--max-json-containers" in err["message"]
    err = error(http.post(CH, json={"messages": MSG * 19 + [{"role": "user", "content": [{"type": "text"}]}]}), 400,
                None, "json_too_many_containers")
    assert http.post(C, json={"prompt": [[1]] * 5, "stop": ["{[", "]"], "max_tokens": 1}).status_code == 200


LONE = "\ud800"
SURROGATES = [  # (path, body, param)
    (C, {"model": "a" + LONE, "prompt": "x"}, "model"),
    (C, {"prompt": "x" + LONE}, "prompt"),
    (C, {"prompt": ["ok", LONE]}, "prompt[1]"),
    (C, {"prompt": "x", "stop": ["s", "t" + LONE]}, "stop[1]"),
    (C, {"prompt": "x", "user": LONE}, "user"),
    (CH, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b" + LONE}]}, "messages[1].content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages[0].content[0].text"),
    (S, {"prefix": "p" + LONE, "candidates": ["b"]}, "prefix"),
    (S, {"prefix": "p", "candidates": ["b", "\udfff"]}, "candidates[1]"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_invalid_unicode_is_a_400_naming_the_field(http, path, body, param):
    raw = json.dumps(body).encode()  # json.dumps writes the lone surrogate as the escape \ud800
    assert b"\\ud" in raw
    err = error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400, param,
                "invalid_unicode")
    assert "Unicode" in err["message"]


def test_invalid_utf8_bytes_are_a_400(http):
    error(http.post(C, content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}), 400, None)


def test_chat_max_tokens_rules(http, served):
    engine = served.engine
    error(http.post(CH, json={"messages": MSG, "max_completion_tokens": 0, "max_tokens": 5}), 400,
          "max_completion_tokens")
    error(http.post(CH, json={"messages": MSG, "max_completion_tokens": 5, "max_tokens": 0}), 400, "max_tokens")
    r = http.post(CH, json={"messages": MSG, "max_completion_tokens": 3, "max_tokens": 9})
    assert r.status_code == 200 and engine.seen[-1].params.max_tokens == 3   # the current field wins
    assert r.json()["usage"]["completion_tokens"] == 3
    http.post(CH, json={"messages": MSG})
    assert engine.seen[-1].params.max_tokens == 40                           # the configured chat default
    long = [{"role": "user", "content": "a" * (MAX_LEN - 30)}]
    http.post(CH, json={"messages": long})
    prompt = len(engine.seen[-1].prompt)
    assert engine.seen[-1].params.max_tokens == min(40, MAX_LEN - prompt)    # never past the context
    error(http.post(CH, json={"messages": MSG, "max_completion_tokens": MAX_LEN}), 400, "max_completion_tokens")


def _depth(x) -> int:
    if isinstance(x, list):
        return 1 + max(map(_depth, x), default=0)
    if isinstance(x, dict):
        return 1 + max(map(_depth, x.values()), default=0)
    return 0


def _random_json(rng: random.Random, depth: int):
    r = rng.random()
    if depth <= 0 or r < 0.25:
        return rng.choice([1, -2.5, None, True, "s", 'q"[{', "\\", "]}\\\"", "é[", "",
                           "\\" * rng.randrange(1, 9) + '"[', '\\"' * rng.randrange(1, 70) + "{"])
    if r < 0.6:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "[b", "c}", '"d']) + str(i): _random_json(rng, depth - 1) for i in range(rng.randrange(4))}


def _containers(x) -> int:
    if isinstance(x, list):
        return 1 + sum(map(_containers, x))
    if isinstance(x, dict):
        return 1 + sum(map(_containers, x.values()))
    return 0


def test_json_depth_matches_a_parser_on_random_json():
    rng = random.Random()  # fresh every run
    for _ in range(300):
        x = _random_json(rng, rng.randrange(12))
        raw = json.dumps(x, ensure_ascii=rng.random() < 0.5).encode()
        assert json_shape(raw) == (_depth(x), _containers(x)), raw


def _scan_depth(body: bytes) -> int:
    """The reference, a byte at a time: a quote after an odd run of backslashes is escaped (in a string or
    not: there JSON has none), brackets count outside strings only, an unterminated string runs to the end."""
    depth = deepest = 0
    in_string = escaped = False
    for c in body:
        if c == ord('"') and not escaped:
            in_string = not in_string
        elif not in_string and c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not in_string and c in b"]}":
            depth -= 1
        escaped = c == ord("\\") and not escaped
    return deepest


def test_json_depth_matches_a_scanner_on_random_bytes():
    rng = random.Random()  # fresh every run
    for _ in range(400):  # lengths across the 64-bit words of the bitmaps; runs of each byte
        body = b"".join(rng.choice([b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b" "])
                        * rng.choice([1, 1, 1, 2, 3, 7, 64]) for _ in range(rng.randrange(0, 200)))
        assert json_depth(body) == _scan_depth(body), body


def test_json_depth_of_malformed_bodies():
    assert json_depth(b'{"prompt": "' + b'\\"' * 50 + b"[[[") == 1   # unterminated: the rest is its text
    assert json_depth(b'[["a\\\\"], [[') == 3                      # an escaped backslash ends no string
    assert json_depth(b'[["a\\\\\\"], [[') == 2                  # an escaped quote does not close it
    assert json_depth(b"") == json_depth(b"]]]") == json_depth(b'"') == 0


N8 = 8 * 1024 * 1024
ADVERSARIAL = {  # 8 MiB bodies: each costs milliseconds (the old string regex: days for the first)
    "escaped quotes, unterminated": b'{"prompt":"' + b'\\"' * (N8 // 2 - 8),
    "backslash runs": b"[" + (b'"' + b"\\" * 7 + b'"[' + b"\\" * 8 + b'",') * (N8 // 20 - 1) + b"1]",
    "brackets in a string": b'{"p":"' + b"[{" * (N8 // 2 - 8) + b'"}',
    "brackets": b"[" * (N8 // 2) + b"]" * (N8 // 2),
    "quotes": b'"' * N8,
    "text": b'{"prompt":"' + b"a" * (N8 - 16) + b'"}',
}


def test_json_depth_is_linear_time():
    small = b'{"prompt":"' + b'\\"' * 10_000  # the old regex: about 3 s (quadratic in the length)
    t0 = time.perf_counter()
    assert json_depth(small) == 1
    assert time.perf_counter() - t0 < 0.2
    for name, body in ADVERSARIAL.items():
        t0 = time.perf_counter()
        json_depth(body)
        assert time.perf_counter() - t0 < 1.0, name  # tens of ms; generous for a loaded CI machine
    assert json_depth(ADVERSARIAL["brackets"]) == N8 // 2 and json_depth(ADVERSARIAL["backslash runs"]) == 1


def test_invalid_unicode_paths():
    assert invalid_unicode({"a": [{"b": "ok"}, {"b": "x\ud800"}]}) == "a[1].b"
    assert invalid_unicode({"a": ["fine", "ünïcode 😀"]}) is None
    assert invalid_unicode({"k\udc00": 1}) == "(an object key)"


def test_only_bodies_that_may_hold_surrogates_are_walked():
    for s in ("\ud800", "a\udfff", "\ud83d\ude00"):  # lone or paired, escaped
        assert may_hold_surrogates(json.dumps({"p": s}).encode())
    assert may_hold_surrogates('{"p": "\ud800"}'.encode("utf-8", "surrogatepass"))  # raw UTF-8 bytes
    assert may_hold_surrogates(b'{"p": "\\uD800"}')
    for x in ({"prompt": [1] * 1000}, {"p": "ünïcode 日本語 \u00e9"}, {"p": "\\u00e9"}):
        assert not may_hold_surrogates(json.dumps(x, ensure_ascii=False).encode())
    # a lone surrogate sent as raw bytes is still found and refused
    with pytest.raises(APIError, match="Unicode") as e:
        parse_request('{"prompt": "x\udc00"}'.encode("utf-8", "surrogatepass"), CompletionRequest)
    assert e.value.param == "prompt"


BAD_ITEMS = 300_000
MANY_BAD = [  # a list of many bad items: one error, not one per item and union member (seconds, GIL held)
    (CompletionRequest, {"prompt": [True] * BAD_ITEMS}, "prompt"),
    (CompletionRequest, {"prompt": [[1]] + [[None]] * BAD_ITEMS}, "prompt"),
    (CompletionRequest, {"prompt": "x", "stop": [1] * (3 * BAD_ITEMS)}, "stop"),
    (ChatCompletionRequest, {"messages": [{}] * BAD_ITEMS}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{}] * BAD_ITEMS}]},
     "messages[0].content"),
    (ScoreRequest, {"prefix": "a", "candidates": [None] * BAD_ITEMS}, "candidates[0]"),
    (ScoreRequest, {"prefix": [1] + [None] * BAD_ITEMS, "candidates": ["b"]}, "prefix"),
]


@pytest.mark.parametrize("model,body,param", MANY_BAD, ids=[f"{m.__name__}-{p}" for m, _, p in MANY_BAD])
def test_validation_stops_at_the_first_bad_item(model, body, param):
    t0 = time.perf_counter()
    with pytest.raises(ValidationError):
        model.model_validate(body)
    assert time.perf_counter() - t0 < 0.3  # 0.5-3 s before (errors for every item and union member)
    with pytest.raises(APIError) as e:
        parse_request(json.dumps(body).encode(), model, Limits(max_json_containers=2 * BAD_ITEMS))
    assert e.value.param == param, e.value.message


def test_limits_validate():
    with pytest.raises(ValueError, match="max-prompts"):
        Limits(max_prompts=0)
    with pytest.raises(ValueError, match="chat-default-max-tokens"):
        ServerConfig(chat_default_max_tokens=0)


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16", "utf-32-le"])
def test_a_body_not_in_utf8_is_a_400(codec):
    """UTF-16 / 32 bodies are refused: json.loads would decode them itself, past the UTF-8 byte scans (a lone
    surrogate escape reached the tokenizer: a 500 from /v1/score). The same body in UTF-8 gets its own 400."""
    from gdnserve.entrypoints.protocol import APIError, CompletionRequest, parse_request
    text = '{"prompt": "a\\ud800b", "max_tokens": 1}'
    with pytest.raises(APIError) as e:
        parse_request(text.encode(codec), CompletionRequest)
    assert e.value.body()["error"]["code"] == "invalid_encoding"
    with pytest.raises(APIError) as e:
        parse_request(text.encode("utf-8"), CompletionRequest)
    assert e.value.body()["error"]["code"] == "invalid_unicode"
