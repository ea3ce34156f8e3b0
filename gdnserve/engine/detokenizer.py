"""Incremental detokenization: O(1) amortised work per generated token (a decode of a few trailing tokens),
holding back only an unfinished UTF-8 sequence.

The text of tokens ``ids[prefix:]`` minus that of ``ids[prefix:read]`` is what token ``read..`` added, decoded
with a few tokens of left context (``prefix``) so tokenizers that merge across tokens (leading spaces,
byte-level pieces) decode as they would in the whole sequence. A decode that ends in U+FFFD may be a
character whose remaining bytes are still to come: it is held back, but for at most ``MAX_HOLD`` tokens (a
UTF-8 sequence has at most 4 bytes), after which the replacement character is emitted as the final text
would show it. So an output that is not valid UTF-8 still streams.
"""
from __future__ import annotations

from typing import Sequence

CONTEXT = 4        # tokens of left context for each decode
MAX_HOLD = 4       # tokens an unfinished character may take to complete


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "prefix", "read")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix = 0     # first token of the decode window
        self.read = 0       # tokens whose text has been emitted

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """The new text since the last call, for ``ids`` (the sample's whole token list, append-only).
        ``final``: the sample has ended: emit whatever is held back."""
        if self.read >= len(ids):
            return ""
        dec = self.tokenizer.decode
        window = list(ids[self.prefix:])
        before = dec(window[:self.read - self.prefix]) if self.read > self.prefix else ""
        text = dec(window)
        if not final and text.endswith("\ufffd") and len(ids) - self.read < MAX_HOLD:
            return ""
        new = text[len(before):]
        self.read = len(ids)
        self.prefix = max(self.prefix, self.read - CONTEXT)
        return new
