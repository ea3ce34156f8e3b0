"""A benchmark-only drafter: proposes the target's own greedy continuation (recorded by a run without
speculation) with a chosen acceptance rate, so speculative decoding on a random-weight model — whose
n-gram acceptance means nothing — can be measured at controlled acceptance.

It plugs into the engine as ``engine.drafter`` (the attribute ``LLMEngine`` calls ``propose_padded`` on);
no engine code changes. Acceptance: at context length L, the first ``a`` of the k drafts are the recorded
tokens and the rest deliberately wrong, with ``a = floor(rate * k + u)`` and ``u`` a hash of (request, L)
in [0, 1): the mean accepted drafts per step is exactly ``rate * k`` and greedy verification accepts
exactly ``a`` (fewer only if the recording ends). A request whose tokens left the recording (a target
argmax that differs between the recording and the spec run, e.g. bf16 rounding) gets wrong drafts from
then on and is counted in ``diverged``.
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

from gdnserve.speculative.ngram import Drafter


class RecordedOracleDrafter(Drafter):
    def __init__(self, futures: Sequence[Sequence[int]], prompt_len: int, k: int, rate: float) -> None:
        """``futures``: per request, prompt + its recorded greedy output; every prompt is ``prompt_len`` long
        and distinct (the prompt identifies the request)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k, self.rate, self.prompt_len = k, rate, prompt_len
        self.futures = {tuple(f[:prompt_len]): (i, list(f)) for i, f in enumerate(futures)}
        if len(self.futures) != len(futures):
            raise ValueError("RecordedOracleDrafter: prompts must be distinct")
        self.diverged: set[int] = set()

    def accepted_at(self, req: int, pos: int) -> int:
        h = hashlib.blake2b(f"{req}:{pos}".encode(), digest_size=8).digest()
        u = int.from_bytes(h, "little") / 2.0 ** 64
        return min(self.k, int(math.floor(self.rate * self.k + u)))

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        req, future = self.futures[tuple(token_ids[:self.prompt_len])]
        pos = len(token_ids)
        # checking the last token suffices: accepted drafts equal the recording, so a token that differs is always
        # the last one its step emitted (the target's own)
        if pos > len(future):
            return []                                # past the recording: padded by propose_padded
        if req in self.diverged or token_ids[-1] != future[pos - 1]:
            self.diverged.add(req)
            return []
        drafts = future[pos:pos + self.k]
        for j in range(self.accepted_at(req, pos), len(drafts)):
            drafts[j] = drafts[j] + 1 if drafts[j] == 0 else drafts[j] - 1     # wrong, inside the vocabulary
        return drafts
