"""Issue 12, items 8-10: incremental detokenization (hold back only an unfinished UTF-8 character, O(1) work per
token), append-only logprobs, the automatic checkpoint after speculative decoding that stops at max_tokens inside
an acceptance, ``published`` for automatic checkpoints, and the spec commit reading the verify step's own
index vectors."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.detokenizer import CONTEXT, MAX_HOLD, IncrementalDetokenizer
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from gdnserve.models.tokenizer import ByteTokenizer


class Counting(ByteTokenizer):
    def __init__(self):
        super().__init__()
        self.lengths = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def stream(tok, ids):
    d, parts = IncrementalDetokenizer(tok), []
    for i in range(1, len(ids) + 1):
        parts.append(d.step(ids[:i], final=i == len(ids)))
    return parts


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenization_equals_whole_decode(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "é", "€", "𝄞", " ", "ok", "\u4e2d"]) for _ in range(300))
    tok = Counting()
    ids = tok.encode(text)
    parts = stream(tok, ids)
    assert "".join(parts) == text and "\ufffd" not in "".join(parts)
    assert max(tok.lengths) <= CONTEXT + MAX_HOLD + 1          # O(1) per token, never the whole output


def test_invalid_utf8_still_streams():
    """An output that is not valid UTF-8 (stray continuation bytes) streams as it goes, not at the end."""
    tok = ByteTokenizer()
    ids = [0x80, 0x80, 0x80] + list(b"abc") * 5 + [0xFF] + list(b"tail" * 3)
    parts = stream(tok, ids)
    first = next(i for i, p in enumerate(parts) if p)
    assert first <= MAX_HOLD and "".join(parts) == tok.decode(ids)


def test_streamed_text_never_shrinks_and_logprobs_append():
    llm = LLM(device="cpu", max_num_seqs=4, num_pages=64)
    e = llm.engine
    rid = e.add_request(None, "Hello", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1))
    texts, lists = [], set()
    while e.has_unfinished():
        for o in e.step():
            texts.append(o.outputs[0].text)
            assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
        if rid in e.requests:
            lists.add(id(e.requests[rid].samples[0].logprobs))
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(lists) == 1                                      # one list, appended to, never rebuilt


@pytest.mark.parametrize("mode", ["replay", "intermediate"])
def test_spec_checkpoint_published_when_acceptance_passes_max_tokens(mode):
    """spec_k = 3 on a repetitive prompt: a verify step accepts more tokens than max_tokens leaves room for; the
    state keeps exactly the emitted tokens, so the automatic checkpoint is published (and says so) and the next
    turn starts from it with the cold run's output."""
    llm = LLM(device="cpu", spec_k=3, spec_mode=mode)
    e = llm.engine
    cold = LLM(device="cpu", auto_checkpoints=False)
    g = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for max_tokens in (2, 3, 4, 5, 6):
        out = llm.generate("abcabcabcabcabcabc", SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == max_tokens and out.checkpoint.published
        nxt = out.prompt_token_ids + out.outputs[0].token_ids + list(b" more")
        warm = llm.generate(nxt, g)[0]
        assert warm.checkpoint.hit_length == len(out.prompt_token_ids) + max_tokens - 1
        assert warm.outputs[0].token_ids == cold.generate(nxt, g)[0].outputs[0].token_ids
        e.evict_checkpoints(len(e.index))
    assert e.counts.spec_accepted > 0


def test_spec_commit_uploads_nothing():
    """Intermediate mode: the commit after a verify reads the verify step's own slot vector and the device
    acceptance counts; no second upload."""
    llm = LLM(device="cpu", spec_k=2, spec_mode="intermediate")
    r = llm.engine.runner
    real, calls = r.accept, []

    def spy(verified, counts=None):
        before = r.stager.turn
        real(verified, counts)
        calls.append((counts is not None, r.stager.turn == before))
    r.accept = spy
    llm.generate("abcabcabcabcabc", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert calls and all(with_counts and no_upload for with_counts, no_upload in calls)
