"""Tokenizers: an HF tokenizer folder built here with the ``tokenizers`` library (byte-level BPE trained
in memory, a tokenizer_config.json with a chat template), checked against transformers' own tokenizer;
the checkpoint marker (exact offsets on fresh random text, and the three invalid placements); the
built-in byte tokenizer."""
from __future__ import annotations

import json
import random
import threading
import time

import jinja2
import pytest
from transformers import AutoTokenizer

from gdnserve.models.builtin import builtin_config
from gdnserve.models.tokenizer import (BYTE_VOCAB_SIZE, DEFAULT_MARKER, SPECIAL_TOKENS, ByteTokenizer, MarkerError,
                                       Tokenizer, load_tokenizer)
from tests.bpe_folder import write_bpe_folder

WORDS = ["the", "state", "checkpoint", "prefix", "hybrid", "delta", "rule", "gated", "attention", "token",
         "héllo", "wörld", "日本語", "naïve", "😀", "über", "x", "42", ",", ".", "\n"]
# A Qwen-style template: rejects unknown roles through HF's raise_exception, uses tojson and loop controls
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "{%- if m.role == 'system' and meta is defined %}{% continue %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if meta is defined %}<|im_start|>meta\n{{ meta | tojson }}<|im_end|>\n{% endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_bpe_folder(tmp_path_factory.mktemp("tok"), WORDS, TEMPLATE, vocab_size=420, generation_config=True)


@pytest.fixture
def rng():
    return random.Random()  # fresh text every run


def test_round_trip_and_ids_match_transformers(hf_folder, rng):
    tok, ref = Tokenizer.from_folder(hf_folder), AutoTokenizer.from_pretrained(hf_folder)
    for _ in range(20):
        text = random_text(rng, rng.randrange(1, 40))
        ids = tok.encode(text)
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.vocab_size == len(ref)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.encode("a<|im_end|>b").count(im_end) == 1
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=False) == "a<|im_end|>b"
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"


def test_long_text_encodes_without_holding_the_gil(hf_folder, rng):
    """The server tokenizes a long prompt in a worker thread; the library's encode holds the GIL throughout,
    which would stall the event loop just the same."""
    tok = Tokenizer.from_folder(hf_folder)
    text = random_text(rng, 60_000)  # 300 KB: 0.5 s of BPE here
    gaps, done = [], threading.Event()

    def tick() -> None:  # the event loop's stand-in: wakes every millisecond, needs the GIL to
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        ids = tok.encode(text, special=False)
    finally:
        done.set()
        ticker.join()
    assert max(gaps) < 0.25, max(gaps)  # 0.5 s before (the whole encode); 0.11 s seen on a loaded 2-core machine
    assert ids == tok._plain_tok.encode(text, add_special_tokens=False).ids


def test_eos_ids_from_tokenizer_config_and_generation_config(hf_folder):
    tok = Tokenizer.from_folder(hf_folder)
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_chat_template_renders_like_transformers(hf_folder, rng):
    tok, ref = load_tokenizer(hf_folder), AutoTokenizer.from_pretrained(hf_folder)
    messages = [{"role": "system", "content": random_text(rng, 5)}, {"role": "user", "content": random_text(rng, 9)},
                {"role": "assistant", "content": random_text(rng, 4)}, {"role": "user", "content": "ü 😀"}]
    for kwargs in ({}, {"meta": {"k": "日本", "n": [1, 2]}}):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
            assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    # (the template's "{%- endfor" strips the newline after each <|im_end|>; HF renders it the same way)
    assert tok.apply_chat_template(messages[1:2]) == \
        f"<|im_start|>user\n{messages[1]['content']}<|im_end|><|im_start|>assistant\n"
    with pytest.raises(jinja2.TemplateError, match="bad role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_from_jinja_file_and_named_list(hf_folder, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_tokenizer(tmp_path).chat_template is None
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token is defined }}"}]}))
    assert load_tokenizer(tmp_path / "tokenizer.json").apply_chat_template([]) == "DFalse"


@pytest.mark.parametrize("make", [lambda f: Tokenizer.from_folder(f), lambda f: ByteTokenizer()], ids=["bpe", "byte"])
def test_marker_offset_is_exact(make, hf_folder, rng):
    tok = make(hf_folder)
    for _ in range(20):
        prefix, suffix = random_text(rng, rng.randrange(1, 30)), random_text(rng, rng.randrange(1, 30))
        sep = rng.choice(["", " ", "\n"])
        ids, offset = tok.encode_with_marker(prefix + sep + DEFAULT_MARKER + suffix)
        head, tail = tok.encode(prefix + sep), tok.encode(suffix)
        assert (ids, offset) == (head + tail, len(head))
        assert tok.decode(ids[:offset]) == prefix + sep and tok.decode(ids[offset:]) == suffix
    text = random_text(rng, 12)
    assert tok.encode_with_marker(text) == (tok.encode(text), None)
    ids, offset = tok.encode_with_marker("ab[[cp]]cd", marker="[[cp]]")
    assert ids[:offset] == tok.encode("ab") and ids[offset:] == tok.encode("cd")


def test_marker_through_chat_template(hf_folder):
    for tok in (Tokenizer.from_folder(hf_folder), ByteTokenizer()):
        text = tok.apply_chat_template([{"role": "user", "content": "the prefix" + DEFAULT_MARKER + " the suffix"}])
        ids, offset = tok.encode_with_marker(text)
        assert tok.decode(ids[:offset], skip_special_tokens=False).endswith("the prefix")
        assert tok.decode(ids[offset:], skip_special_tokens=False).startswith(" the suffix<|im_end|>")


@pytest.mark.parametrize("text,match", [
    (f"a {DEFAULT_MARKER} b {DEFAULT_MARKER} c", "2 times"),
    (f"{DEFAULT_MARKER}{DEFAULT_MARKER}", "2 times"),
    (f"{DEFAULT_MARKER}the rest", "offset 0"),
    (f"the prefix{DEFAULT_MARKER}", "end of the prompt"),
])
@pytest.mark.parametrize("make", [lambda f: Tokenizer.from_folder(f), lambda f: ByteTokenizer()], ids=["bpe", "byte"])
def test_invalid_marker_placements_are_rejected(make, hf_folder, text, match):
    with pytest.raises(MarkerError, match=match) as err:
        make(hf_folder).encode_with_marker(text)
    assert isinstance(err.value, ValueError) and DEFAULT_MARKER in str(err.value)


def test_byte_tokenizer_round_trip_and_specials(rng):
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == BYTE_VOCAB_SIZE == 260
    assert builtin_config().vocab_size == tok.vocab_size
    for _ in range(20):
        text = random_text(rng, rng.randrange(0, 25))
        assert tok.decode(tok.encode(text)) == text
        assert tok.encode(text) == list(text.encode("utf-8"))
    text = "<|im_start|>user\nnaïve 日本語 😀<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert [i for i in ids if i >= 256] == [257, 258, 256]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nnaïve 日本語 😀\n"
    assert [tok.encode(s) for s in SPECIAL_TOKENS] == [[256], [257], [258], [259]]
    assert tok.eos_token_ids == (258, 256)


def test_byte_tokenizer_partial_utf8_and_bad_ids():
    tok = ByteTokenizer()
    smile = "😀".encode("utf-8")
    assert tok.decode(list(smile[:2])) == "\ufffd"
    # a special token between the halves of a character ends it: no byte is glued across a special
    assert tok.decode(list(smile[:2]) + [258] + list(smile[2:]), skip_special_tokens=False).count("<|im_end|>") == 1
    for bad in (-1, BYTE_VOCAB_SIZE):
        with pytest.raises(ValueError, match=str(bad)):
            tok.decode([65, bad])


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}]
    assert tok.apply_chat_template(msgs) == \
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("héllo<|im_end|>\n")
