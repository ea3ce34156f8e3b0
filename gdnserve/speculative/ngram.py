"""Host-side drafters that see only a request's token ids (prompt + generated so far).

``NgramDrafter`` is prompt-lookup decoding: the longest suffix n-gram of the context that occurred
earlier predicts that what followed it then follows now. It needs no weights and pays off where output
copies input (code edits, RAG answers, repetition). ``OracleDrafter`` drafts the target's own future
with a chosen number of errors, so tests can drive every acceptance count 0..k.

Cost. The search reads only the last ``window`` tokens (default 2048): converting them to an int64
array dominates (~40 µs for 2048 tokens, ~160 µs for 10k), the vectorised n-gram scan is ~5 µs per
10k. Pass a ``numpy`` int64 array (e.g. a per-request token buffer) to skip the conversion.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np


class Drafter(ABC):
    """Proposes up to ``k`` next tokens for one request from its token ids; stateless across calls."""
    k: int

    @abstractmethod
    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids``; ``[]`` when there is no guess."""

    def propose_padded(self, token_ids: Sequence[int], k: int | None = None) -> tuple[list[int], int]:
        """Exactly ``k`` drafts (default ``self.k``) and how many of them are real proposals.

        The verify step runs a fixed K + 1 tokens per request, so missing drafts are padded with the last
        proposed token, else the last context token (a repeat is as likely as any guess). Padding needs
        no special case downstream: the target verifies it like any draft."""
        k = self.k if k is None else k
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if len(token_ids) == 0:
            raise ValueError("token_ids must hold at least one token (the prompt is never empty)")
        drafts = self.propose(token_ids)[:k]
        num_real = len(drafts)
        fill = drafts[-1] if drafts else int(token_ids[-1])
        return drafts + [fill] * (k - num_real), num_real


class NgramDrafter(Drafter):
    """Prompt lookup: for n from ``max_ngram`` down to ``min_ngram``, find the most recent earlier
    occurrence of the context's last n tokens within the last ``window`` tokens and propose the k tokens
    that followed it. The followers are read from the context extended by the drafts themselves, so an
    occurrence that overlaps the suffix (the context repeats with period p) continues the repetition
    for all k tokens instead of stopping at the end of the context."""

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1, window: int = 2048) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if window < max_ngram + 1:
            raise ValueError(f"window must be >= max_ngram + 1 = {max_ngram + 1}, got {window}")
        self.k, self.max_ngram, self.min_ngram, self.window = k, max_ngram, min_ngram, window

    def _match_end(self, ctx: np.ndarray) -> int:
        """End (exclusive) of the most recent earlier occurrence of the longest matching suffix n-gram,
        or -1. ``match[t]``: the n-gram ending at index t (end t + 1 <= L - 1, so something follows it)
        equals the suffix; each longer n narrows the previous n's matches by one more comparison."""
        L = len(ctx)
        match = ctx[:-1] == ctx[-1]
        best = -1
        for n in range(1, min(self.max_ngram, L - 1) + 1):
            if n > 1:
                match[n - 1:] &= ctx[:L - n] == ctx[L - n]
                match[n - 2] = False  # that n-gram would start before the window
            hits = np.flatnonzero(match)
            if hits.size == 0:
                break  # no longer n-gram can match either
            if n >= self.min_ngram:
                best = int(hits[-1]) + 1
        return best

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        ctx = np.asarray(token_ids[-self.window:], dtype=np.int64)
        if ctx.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {ctx.shape}")
        if len(ctx) < 2:
            return []
        end = self._match_end(ctx)
        if end < 0:
            return []
        period = len(ctx) - end  # >= 1; followers past the context repeat with this period
        return ctx[end + np.arange(self.k) % period].tolist()


class OracleDrafter(Drafter):
    """Drafts the target's own next tokens with deliberate errors (for tests).

    ``future``: the full reference sequence, prompt included (e.g. prompt + the target's greedy output);
    the drafts for a context of length L are ``future[L:L + k]`` with the LAST ``e`` of the k positions
    replaced by a different token, so greedy verification accepts exactly ``k - e`` (fewer only where
    ``future`` ends). ``errors_per_step`` is ``e``, or a function of L giving it per step."""

    def __init__(self, future: Sequence[int], k: int, errors_per_step: int | Callable[[int], int] = 0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.future, self.k, self.errors_per_step = list(future), k, errors_per_step

    def errors_at(self, pos: int) -> int:
        e = self.errors_per_step(pos) if callable(self.errors_per_step) else self.errors_per_step
        if not 0 <= e <= self.k:
            raise ValueError(f"errors_per_step must be in 0..{self.k}, got {e} at context length {pos}")
        return e

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        pos = len(token_ids)
        if not 0 < pos <= len(self.future) or token_ids[-1] != self.future[pos - 1]:
            raise ValueError(f"token_ids (length {pos}) diverged from the oracle's future "
                             f"(length {len(self.future)})")
        drafts = self.future[pos:pos + self.k]
        for j in range(self.k - self.errors_at(pos), len(drafts)):
            drafts[j] = drafts[j] - 1 if drafts[j] > 0 else drafts[j] + 1  # wrong, and inside any vocab >= 2
        return drafts
