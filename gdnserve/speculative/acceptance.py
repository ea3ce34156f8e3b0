"""Acceptance of a verify step: how many of each row's k drafts to keep, and the one token after them.

The verify step feeds the target K + 1 tokens per row (the last accepted token, then drafts
``x_0 .. x_{k-1}``) and gets K + 1 next-token distributions: position i is the target's distribution
for the token that follows ``x_0 .. x_{i-1}``, the last one (i = k) the "bonus" after all k drafts.
Both functions return ``num_accepted: [B] int64`` and ``emitted: [B, k+1] int64``, where row b's output
is ``emitted[b, :num_accepted[b] + 1]`` (the accepted drafts, then the target's token at the first
rejection or the bonus) and -1 after it. Everything is vectorised with no host sync; ``emitted_tokens``
brings the lists to the host with one copy.

Greedy rows go through ``greedy_accept``. Sampling rows go through ``rejection_sample`` (speculative
sampling, Leviathan et al. 2023 / Chen et al. 2023): accept ``x_i`` with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection draw from ``norm(max(0, p_i - q_i))``; after k
acceptances draw the bonus from ``p_k``. Every emitted token then follows ``p`` exactly, whatever q is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_TINY = torch.finfo(torch.float32).tiny


def _check_drafts(draft_ids: torch.Tensor, target: torch.Tensor, target_name: str) -> tuple[int, int]:
    if draft_ids.dim() != 2 or draft_ids.dtype != torch.int64:
        raise ValueError(f"draft_ids must be [B, k] int64, got {tuple(draft_ids.shape)} {draft_ids.dtype}")
    B, k = draft_ids.shape
    if target.shape[:2] != (B, k + 1) or target.device != draft_ids.device:
        raise ValueError(f"{target_name} must be [{B}, {k + 1}, ...] on {draft_ids.device} to match draft_ids "
                         f"[{B}, {k}], got {tuple(target.shape)} on {target.device}")
    return B, k


def _emitted(cum: torch.Tensor, draft_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """``cum: [B, k]`` 0/1, 1 while every draft so far was accepted -> ``[B, k+1]``: drafts where
    accepted, ``next_ids [B]`` at the first rejection (or the bonus position), -1 after."""
    is_draft = F.pad(cum, (0, 1), value=0).bool()   # position j < num_accepted
    reached = F.pad(cum, (1, 0), value=1).bool()    # position j <= num_accepted
    drafts = F.pad(draft_ids, (0, 1), value=-1)
    return torch.where(is_draft, drafts, torch.where(reached, next_ids[:, None], -1))


def greedy_accept(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match, left to right. ``draft_ids: [B, k] int64``, ``target_argmax: [B, k+1] int64`` (the
    target's argmax at each verify position) -> ``num_accepted: [B] int64``, ``emitted: [B, k+1] int64``
    (module docstring). An accepted draft equals the target's argmax, so the output is exactly what
    greedy decoding without drafts produces."""
    B, k = _check_drafts(draft_ids, target_argmax, "target_argmax")
    if target_argmax.dim() != 2 or target_argmax.dtype != torch.int64:
        raise ValueError(f"target_argmax must be [B, k+1] int64, "
                         f"got {tuple(target_argmax.shape)} {target_argmax.dtype}")
    cum = (draft_ids == target_argmax[:, :k]).long().cumprod(1)  # a match after a mismatch counts for nothing
    num_accepted = cum.sum(1)
    return num_accepted, _emitted(cum, draft_ids, target_argmax.gather(1, num_accepted[:, None]).squeeze(1))


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (module docstring). ``draft_ids: [B, k] int64``; ``draft_probs: [B, k, V]``,
    the distributions the drafts were drawn from, or None for deterministic drafts (n-gram, oracle, a
    greedy draft model: q is one-hot); ``target_probs: [B, k+1, V]`` float; ``generator`` on their device.
    Returns ``num_accepted: [B] int64``, ``emitted: [B, k+1] int64``.

    ``target_probs`` must be the distribution the sampler would draw from, after temperature, top-k and
    top-p, or the output follows the unfiltered distribution instead: flatten the verify logits to
    ``[B*(k+1), V]``, build ``SamplingTensors`` from each row's params repeated k + 1 times and take
    ``Sampler.probs(logits, tensors).view(B, k + 1, V)``. Rows need not be normalised exactly (fp32
    softmax is fine). A greedy row given a one-hot target reduces to exact match, but ``greedy_accept``
    is cheaper. One generator serves the batch: a seeded request does not reproduce its non-speculative
    tokens (the draws differ)."""
    B, k = _check_drafts(draft_ids, target_probs, "target_probs")
    if target_probs.dim() != 3 or not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be [B, k+1, V] float, "
                         f"got {tuple(target_probs.shape)} {target_probs.dtype}")
    V, device, p = target_probs.shape[2], target_probs.device, target_probs
    if draft_probs is not None and (draft_probs.shape != (B, k, V) or draft_probs.dtype != p.dtype
                                    or draft_probs.device != device):
        raise ValueError(f"draft_probs must be [{B}, {k}, {V}] {p.dtype} on {device} like target_probs, "
                         f"got {tuple(draft_probs.shape)} {draft_probs.dtype} on {draft_probs.device}")

    # accept x_i iff u < p_i(x_i) / q_i(x_i), written without the division (q = 0 cannot divide by zero)
    p_draft = p[:, :k].gather(2, draft_ids[..., None]).squeeze(2)
    u = torch.rand((B, k), generator=generator, device=device, dtype=p.dtype)
    if draft_probs is None:
        accept = u < p_draft
    else:
        accept = u * draft_probs.gather(2, draft_ids[..., None]).squeeze(2) < p_draft
    cum = accept.long().cumprod(1)
    num_accepted = cum.sum(1)

    # the distribution at position num_accepted: the residual at a rejection, p_k itself for the bonus
    p_next = p.gather(1, num_accepted[:, None, None].expand(B, 1, V)).squeeze(1)
    if k > 0:
        rejected = (num_accepted < k)[:, None]
        j = num_accepted.clamp(max=k - 1)[:, None]
        if draft_probs is None:  # max(0, p - onehot(x)) is p with x's entry zeroed
            x = draft_ids.gather(1, j)
            residual = p_next.scatter(1, x, torch.where(rejected, 0.0, p_next.gather(1, x)))
        else:
            q_next = draft_probs.gather(1, j[..., None].expand(B, 1, V)).squeeze(1)
            residual = torch.where(rejected, (p_next - q_next).clamp_min_(0), p_next)
        # a rejection where p ~= q can leave rounding noise or nothing; an empty residual falls back to p
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    else:
        residual = p_next
    # exponential race, as in the sampler: argmax(w / E) draws from w / sum(w), no normalising needed
    noise = torch.empty_like(residual).exponential_(generator=generator)
    next_ids = residual.div_(noise.clamp_min_(_TINY)).argmax(-1)
    return num_accepted, _emitted(cum, draft_ids, next_ids)


def emitted_tokens(num_accepted: torch.Tensor, emitted: torch.Tensor) -> list[list[int]]:
    """Each row's output tokens as host lists, ``emitted[b, :num_accepted[b] + 1]``, with one
    device-to-host copy for the batch."""
    rows = torch.cat([num_accepted[:, None], emitted], 1).tolist()
    return [r[1:r[0] + 2] for r in rows]
