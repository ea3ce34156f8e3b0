"""Request limits: what one HTTP request may ask of the server, and the checks that run on the raw body
before (nesting depth) and after (invalid Unicode) it is parsed. Each limit has a ``gdnserve serve`` flag
(``docs/serving.md`` lists them with their defaults); a request over a limit is answered with an
OpenAI-style error that names the field, never a 500.
"""
from __future__ import annotations

import re
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
    max_candidates: int = 1024              # candidates (items) in one /v1/score request
    max_n: int = 64                         # samples per prompt
    max_logprobs: int = 20                  # logprobs / top_logprobs

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} (--{name.replace('_', '-')}) must be a positive integer, got {value!r}")


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: deleted below
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, without parsing it (strings skipped;
    vectorised, so a body of megabytes of brackets costs milliseconds, not a RecursionError)."""
    brackets = _STRING.sub(b"", body).translate(None, _BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max())


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
