"""Request limits: what one HTTP request may ask of the server, and the checks that run on the raw body
before (nesting depth, number of arrays and objects) and after (invalid Unicode) it is parsed. Each limit has a ``gdnserve serve`` flag
(``docs/serving.md`` lists them with their defaults); a request over a limit is answered with an
OpenAI-style error that names the field, never a 500.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024   # 413 above; checked on Content-Length and on the bytes read
    max_prompts: int = 64                   # prompts in one /v1/completions request
    max_stop: int = 16                      # stop strings per request
    max_stop_chars: int = 256               # characters per stop string
    max_json_depth: int = 32                # nested arrays / objects in a body
    max_json_containers: int = 16384        # arrays + objects in a body (each costs pydantic ~5 µs, GIL held)
    max_candidates: int = 1024              # candidates (items) in one /v1/score request
    max_n: int = 64                         # samples per prompt
    max_logprobs: int = 20                  # logprobs / top_logprobs

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} (--{name.replace('_', '-')}) must be a positive integer, got {value!r}")


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_FOLD = 0xDF  # byte & _FOLD maps { to [ and } to ], and nothing else to either
_U64 = np.dtype("<u8")


def json_depth(body: bytes) -> int:
    return json_shape(body)[0]


def json_shape(body: bytes) -> tuple[int, int]:
    """``(depth, containers)`` of a JSON text, without parsing it: the deepest nesting of arrays and objects,
    and how many there are. A few vectorised passes over the bytes and their bitmaps, so any body within the
    size limit costs milliseconds (no RecursionError, no backtracking). Exact for valid JSON.

    A quote delimits a string unless an odd run of backslashes precedes it (in valid JSON backslashes only
    occur in strings); brackets after an odd number of delimiting quotes are text. An unterminated string
    runs to the end of the body, so a malformed body is never deeper than what precedes it (the parser then
    names the problem)."""
    b = np.frombuffer(body, dtype=np.uint8)
    outside = ~_prefix_xor(_delimiting_quotes(b))
    folded = b & _FOLD
    opens = (folded == ord("[")) & outside
    brackets = opens | ((folded == ord("]")) & outside)
    if not brackets.any():
        return 0, 0
    steps = opens[brackets].view(np.int8) * np.int8(2) - np.int8(1)
    return max(0, int(np.cumsum(steps, dtype=np.int32).max())), int(np.count_nonzero(opens))


def _delimiting_quotes(b: np.ndarray) -> np.ndarray:
    """The quote bytes of ``b`` not escaped by an odd run of backslashes, as a bool mask. The runs are found
    with simdjson's carry trick on the backslash bitmap as one Python integer: adding a run's first bit
    carries to the bit just past the run, so runs starting at even and at odd positions, added separately,
    mark where each run ends; a run is odd when its end and its start differ in parity."""
    quote = b == _QUOTE
    backslash = b == _BACKSLASH
    if not backslash.any():
        return quote
    n = len(b)
    x = int.from_bytes(np.packbits(backslash, bitorder="little").tobytes(), "little")
    even = int.from_bytes(b"\x55" * (n // 8 + 1), "little")  # bits 0, 2, 4, ... past bit n
    starts = x & ~(x << 1)
    after_even = (x + (starts & even)) & ~x  # just past each run that starts at an even position
    after_odd = (x + (starts & ~even)) & ~x
    escaped = (after_even & ~even) | (after_odd & even)
    bits = np.frombuffer(escaped.to_bytes(n // 8 + 2, "little"), dtype=np.uint8)
    return quote & ~np.unpackbits(bits, count=n, bitorder="little").view(bool)


def _prefix_xor(mask: np.ndarray) -> np.ndarray:
    """``out[i] = mask[0] ^ ... ^ mask[i]`` for a bool mask, on its bitmap in 64-bit words: six shifts
    within each word, then each word flipped by the parity of the words before it."""
    n = len(mask)
    packed = np.packbits(mask, bitorder="little")
    words = np.concatenate([packed, np.zeros(-len(packed) % 8, np.uint8)]).view(_U64)
    for shift in (1, 2, 4, 8, 16, 32):
        words ^= words << np.uint64(shift)
    parity = np.bitwise_xor.accumulate(words >> np.uint64(63))  # of each word and those before it
    words[1:] ^= np.uint64(0) - parity[:-1]                     # all ones where the parity before is odd
    return np.unpackbits(words.view(np.uint8), count=n, bitorder="little").view(bool)


def may_hold_surrogates(body: bytes) -> bool:
    """False when no string parsed from ``body`` can hold a lone surrogate: it has neither an escape
    ``\\uD8xx``-``\\uDFxx`` nor the byte 0xED that leads U+D800-U+DFFF in UTF-8 (``json.loads`` decodes
    bytes with ``surrogatepass``). A byte search: the walk of ``invalid_unicode`` takes seconds over
    millions of values and runs only for the bodies that pass this."""
    return b"\\ud" in body or b"\\uD" in body or b"\xed" in body


def invalid_unicode(data: Any, path: str = "") -> str | None:
    """The field path (``messages[0].content``) of the first string (or object key) in parsed JSON that
    is not valid Unicode (a lone surrogate such as ``"\\ud800"``); None when all are valid."""
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack:
        x, where = stack.pop()
        if isinstance(x, str):
            if not _encodable(x):
                return where or None
        elif isinstance(x, dict):
            for k, v in x.items():
                sub = f"{where}.{k}" if where else str(k)
                if not _encodable(k):
                    return where or "(an object key)"
                stack.append((v, sub))
        elif isinstance(x, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(x) if isinstance(v, (str, dict, list)))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
