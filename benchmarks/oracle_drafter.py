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


def accepted_count(rate: float, k: int, u: float) -> int:
    """The drafts a step accepts: floor(rate x k + u) for u uniform in [0, 1) (mean rate x k), at most k."""
    return min(k, math.floor(rate * k + u))


def wrong(token: int) -> int:
    """A token other than ``token``, inside the vocabulary."""
    return token + 1 if token == 0 else token - 1


class ChainOracleDrafter(Drafter):
    """Oracle drafts for a model with a greedy chain (``random_model.make_greedy_chain_``: the greedy token after t
    is pi(t)), no recording needed, so a server can use it on whatever prompts arrive: after context ending in t
    the drafts are pi(t), pi(pi(t)), ..., the first ``a`` right and the rest wrong, ``a`` as in
    :class:`RecordedOracleDrafter` (u a hash of the context's first 16 tokens and its length). Greedy verification
    accepts exactly ``a`` while the target follows the chain."""

    def __init__(self, perm: Sequence[int], k: int, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.perm, self.k, self.rate = list(perm), k, rate

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        h = hashlib.blake2b(f"{list(token_ids[:16])}:{len(token_ids)}".encode(), digest_size=8).digest()
        a = accepted_count(self.rate, self.k, int.from_bytes(h, "little") / 2.0 ** 64)
        out, t = [], int(token_ids[-1])
        for j in range(self.k):
            t = self.perm[t]
            out.append(t if j < a else wrong(t))
        return out


class ChainOracleMTP:
    """The same oracle for the MTP drafter: wraps ``runner.mtp.draft`` so that the MTP head still runs its k steps
    (their cost is what speculative decoding with MTP pays) and its drafts are then replaced, on the device, by the
    greedy chain of each request's last token with the first ``a`` right, ``a = floor(rate x k + u)`` with u a
    32-bit integer hash of (the request's position, its last token, ``seed``) in [0, 1): no generator state, so the
    wrapper runs inside the verify step's CUDA graph (it is called where the head is, at capture)."""

    def __init__(self, mtp, perm, k: int, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.perm, self.k, self.rate, self.seed, self.real = perm, k, rate, seed, mtp.draft
        mtp.draft = self.draft

    def draft(self, first_tokens, meta):
        import torch
        self.real(first_tokens, meta)                       # the MTP head's k steps (and their KV), as served
        t, chain = first_tokens, []
        for _ in range(self.k):
            t = self.perm[t]
            chain.append(t)
        d = torch.stack(chain, 1)
        u = uniform_hash(meta.positions[0] * 1000003 + first_tokens * 7919 + self.seed)
        a = torch.clamp(torch.floor(self.rate * self.k + u), max=self.k)
        bad = torch.arange(self.k, device=d.device)[None, :] >= a[:, None]
        return torch.where(bad, torch.where(d == 0, d + 1, d - 1), d)


def uniform_hash(x):
    """int64 tensor -> float64 in [0, 1): a 32-bit integer hash (the "lowbias32" mix) of x's low 32 bits. The
    int64 products wrap, which keeps their low 32 bits (all the mask keeps)."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
    x = ((x ^ (x >> 15)) * 0x846CA68B) & m
    return (x ^ (x >> 16)).double() / 2.0 ** 32


def install_chain_oracle(engine, perm, rate: float, seed: int = 0) -> str:
    """Oracle drafts at ``rate`` for ``engine`` (spec_k > 0) over a greedy-chain model whose permutation is ``perm``
    ([vocab] int64 on the model's device): the MTP drafter's output replaced (spec_draft mtp) or the n-gram drafter
    replaced. Returns what was installed, for the banner."""
    cfg = engine.config
    if not cfg.spec_k:
        raise ValueError("spec oracle: needs --spec-k > 0")
    if cfg.spec_draft == "mtp":
        ChainOracleMTP(engine.runner.mtp, perm, cfg.spec_k, rate, seed)
    else:
        engine.drafter = ChainOracleDrafter(perm.tolist(), cfg.spec_k, rate)
    return f"{cfg.spec_draft} k={cfg.spec_k}, oracle drafts at {rate:g} per draft token (greedy chain)"
