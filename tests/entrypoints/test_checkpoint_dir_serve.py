"""Checkpoints that survive a restart of the real server (`gdnserve serve --checkpoint-dir`, embedded model, CPU):
the first process answers two conversations and their next turns and is stopped (a graceful stop writes its
checkpoints to the directory); a second process on the same directory answers the same next turns from the
persisted checkpoints (provenance tier "disk") with the first run's outputs, counts them in /metrics and shows the
tiers in its banner."""
from __future__ import annotations

import random

import pytest

httpx = pytest.importorskip("httpx")
from tests.entrypoints.live_server import start_server  # noqa: E402  (needs httpx)

_rng = random.Random(30)
CONVS = [[_rng.randrange(3, 250) for _ in range(17 + 5 * i)] for i in range(2)]


def run(url: str, ids: list[int]) -> tuple[str, dict]:
    """Greedy, 4 tokens: (text, the prompt's provenance record)."""
    r = httpx.post(url + "/v1/completions", json={"model": "gdnserve-embedded", "prompt": ids, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["gdnserve"]["prompts"][0]


def output_ids() -> tuple[list[list[int]], object]:
    """The conversations' output token ids (the responses carry text only), from the same embedded model in this
    process; checked against the server's text below."""
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.entrypoints.llm import LLM
    with LLM(device="cpu", max_num_seqs=2, num_pages=256) as llm:
        e = llm.engine
        outs = llm.generate(CONVS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs], e.tokenizer


def test_checkpoints_survive_a_restart(tmp_path):
    flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--num-pages", "256", "--max-num-seqs", "4"]
    proc, url, log = start_server(flags, tmp_path / "first.log")
    try:
        outs, tok = output_ids()
        turns = []
        for ids, out in zip(CONVS, outs):
            text, prov = run(url, ids)
            assert prov["published"] and text == tok.decode(out)
        for ids, out in zip(CONVS, outs):     # the next turn: prompt + output + a new user message
            nxt = ids + out + [11, 12, 13]
            text, prov = run(url, nxt)
            assert prov["tier"] == "gpu" and prov["hit_length"] == len(ids) + len(out) - 1
            turns.append((nxt, text, prov["hit_length"]))
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert list((tmp_path / "ckpt").glob("*/*.gck")), (tmp_path / "first.log").read_text()
    proc, url, log = start_server(flags, tmp_path / "second.log")
    try:
        for nxt, text, hit in turns:
            got, prov = run(url, nxt)
            assert prov["tier"] == "disk" and prov["hit_length"] == hit
            assert got == text                       # the restored state gives the first run's output
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert 'gdnserve:checkpoint_tier_hits_total{tier="disk"} 2.0' in metrics
    assert 'gdnserve:checkpoint_restores_total{tier="disk"} 2.0' in metrics
    assert "gdnserve:checkpoint_restore_seconds_count 2.0" in metrics
    banner = (tmp_path / "second.log").read_text()
    assert "checkpoint tiers:" in banner and "found)" in banner
