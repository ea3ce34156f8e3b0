"""``ignore_eos`` on /v1/completions and /v1/chat/completions (vLLM's request extension, what the HTTP benchmark's
fixed-length workloads send): the real engine behind the real server, on the embedded model with ``<|im_end|>``'s
tied embedding row set so that it is the greedy next token of PROMPT: without the field the request stops there
(finish "stop", one token), with it the request runs to max_tokens (finish "length")."""
from __future__ import annotations

import json

import pytest
import torch

httpx = pytest.importorskip("httpx")

from gdnserve.engine.async_engine import AsyncEngine  # noqa: E402
from gdnserve.engine.config import EngineConfig  # noqa: E402
from gdnserve.engine.execution.model_runner import (  # noqa: E402
    ModelRunner,
    PrefillItem,
    RunnerConfig,
)
from gdnserve.engine.llm_engine import LLMEngine  # noqa: E402
from gdnserve.models.builtin import build_builtin_model  # noqa: E402
from gdnserve.models.tokenizer import ByteTokenizer  # noqa: E402
from tests.entrypoints.fake_engine import Served  # noqa: E402

TOK = ByteTokenizer()
EOS = TOK.eos_token_ids[0]
PROMPT = "Does it ever stop?"


@pytest.fixture(scope="module")
def served():
    model = build_builtin_model()
    runner = ModelRunner(model, RunnerConfig(num_slots=2, num_pages=8, page_size=16))
    logits = runner.step([PrefillItem(runner.new_seq(), TOK.encode(PROMPT))], [])[0]
    hi, lo = int(logits.argmax()), int(logits.argmin())
    with torch.no_grad():   # 3x the row of the top (positive) or -3x the bottom (negative) logit: EOS outscores it
        emb = model.embed_tokens.weight
        emb[EOS] = 3 * emb[hi] if logits[hi] > 0 else -3 * emb[lo]
    engine = LLMEngine(model, TOK, EngineConfig(num_pages=256, max_num_seqs=4, max_model_len=256))
    s = Served(AsyncEngine(engine))
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_runs_to_max_tokens(served, stream):
    def completion(**extra) -> tuple[str, int]:
        body = {"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "stream": stream, **extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        return finish[0], events[-1]["usage"]["completion_tokens"]
    assert completion() == ("stop", 1)
    assert completion(ignore_eos=True) == ("length", 9)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "ignore_eos": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"      # strict: a bool


def test_chat_takes_it_too(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
