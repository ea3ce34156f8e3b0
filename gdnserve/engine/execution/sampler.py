"""Sampler: last-token logits -> token ids and logprobs, one vectorised pass over the batch.

Per-row temperature, top-k and top-p are device tensors (``SamplingTensors``, built once per batch
composition and cacheable by the caller), so nothing loops over rows except the seeding of seeded rows.
Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. per token
draws exactly from ``probs`` (it is the Gumbel-max trick, ``-log E`` being Gumbel), needs no cumulative
sum or ``multinomial``, and never syncs with the host.

Seeds. A row whose request has ``seed = s``, at generation step ``t`` (0 for its first generated token)
and sample index ``i`` (which of the ``n`` samples of its prompt; 0 when n = 1), draws its noise row
``E[V]`` from a ``torch.Generator`` on the logits' device seeded with ``row_seed(s, t, i)``, a splitmix64
chain over (s, i, t). Its token therefore depends only on (s, i, t) and its own logits row: not on the
batch, its position in it, other requests or earlier calls. Streams differ between the CPU and CUDA
generators, so a seed reproduces on one device type. Unseeded rows share one draw from the sampler's
own generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from gdnserve.engine.sampling_params import SamplingParams

_M64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny
_MIN_T = 1e-5   # SamplingParams normalises smaller temperatures to greedy; a guard for hand-built params


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int, sample_index: int = 0) -> int:
    """The generator seed of a seeded row (module docstring); 63 bits, which every generator accepts."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ (sample_index & _M64)) ^ (step & _M64))
    return h >> 1


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """One batch's per-row parameters on the device, and the host facts that choose the code path."""
    temperature: torch.Tensor  # [B] fp32; 1.0 on greedy rows so the division stays harmless
    greedy: torch.Tensor       # [B] bool, temperature == 0
    top_p: torch.Tensor        # [B] fp32, 1.0 = off (and on greedy rows)
    top_k: torch.Tensor        # [B] int64, 0 = off (and on greedy rows)
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    max_top_k: int             # 0 = no row uses top-k
    max_logprobs: int          # top alternatives returned per row (max over rows), 0 = none
    seeded: tuple[tuple[int, int], ...]  # (row, seed) of the sampling (non-greedy) seeded rows
    any_unseeded: bool         # a sampling row draws from the sampler's own generator

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingTensors:
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        host = torch.tensor([[1.0 if g else max(p.temperature, _MIN_T) for p, g in zip(params, greedy)],
                             [float(g) for g in greedy],
                             [1.0 if g else p.top_p for p, g in zip(params, greedy)],
                             [0.0 if g else float(p.top_k) for p, g in zip(params, greedy)]],
                            dtype=torch.float32)
        if device.type == "cuda":  # one non-blocking copy from pinned memory
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        sampling = [p for p, g in zip(params, greedy) if not g]
        return cls(temperature=dev[0], greedy=dev[1] > 0, top_p=dev[2], top_k=dev[3].long(),
                   all_greedy=all(greedy), any_greedy=any(greedy),
                   any_top_p=any(p.top_p < 1 for p in sampling),
                   max_top_k=max((p.top_k for p in sampling), default=0),
                   max_logprobs=max((p.logprobs or 0 for p in params), default=0),
                   seeded=tuple((i, p.seed) for i, (p, g) in enumerate(zip(params, greedy))
                                if not g and p.seed is not None),
                   any_unseeded=any(p.seed is None for p in sampling))


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: torch.Tensor            # [B] int64, on the logits' device
    logprobs: torch.Tensor             # [B] fp32, log_softmax(raw logits) at token_ids
    top_ids: torch.Tensor | None       # [B, N] int64, N = max requested logprobs; None when N = 0
    top_logprobs: torch.Tensor | None  # [B, N] fp32, descending; row i reads its first logprobs_i


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log_softmax of the RAW logits at ``token_ids``, plus the ``num_top`` largest, sorted descending.

    ``logits: [N, V]``, ``token_ids: [N] int64`` -> ``([N], [N, num_top] ids | None, [N, num_top] | None)``.
    Serves sampled tokens, prompt_logprobs (logits of position j, ids of token j + 1) and scoring.
    Computed as ``logits - logsumexp`` so no [N, V] log-prob tensor is materialised.
    """
    lse = logits.logsumexp(-1)
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1) - lse
    num_top = min(num_top, logits.shape[1])
    if num_top <= 0:
        return chosen, None, None
    values, ids = logits.topk(num_top, dim=-1)
    return chosen, ids, values - lse[:, None]


ROW_BLOCK = 512     # rows of a [rows, vocab] temporary at a time in the all-rows paths (prompt logprobs, scores):
                    # 512 x 248,320 fp32 = 0.5 GB, where a whole 4,096-token step's rows took ~4 GB per temporary


def token_logprobs_rows(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, num_top: int = 0,
                        block: int = ROW_BLOCK) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``token_logprobs(logits[rows], token_ids, num_top)``, ``block`` rows at a time: the temporaries (the gathered
    rows, their exponentials) stay block-sized instead of [N, vocab] (the memory plan's activation peak measures
    this, memory_budget.measure_activations)."""
    if rows.numel() <= block:
        return token_logprobs(logits[rows], token_ids, num_top)
    parts = [token_logprobs(logits[rows[i:i + block]], token_ids[i:i + block], num_top)
             for i in range(0, rows.numel(), block)]
    chosen = torch.cat([p[0] for p in parts])
    if parts[0][1] is None:
        return chosen, None, None
    return chosen, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _keep_threshold(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Per row, the smallest scaled logit kept by top-k then top-p: [B]. Comparing by value (not by
    sorted rank) keeps every token tied with the last kept one, so the result never depends on
    token-id order."""
    B, V = x.shape
    k = torch.where(t.top_k > 0, t.top_k.clamp(max=V), V)
    if not t.any_top_p:  # top-k only: a partial sort to the largest k suffices
        kmax = min(t.max_top_k, V)
        values = x.topk(kmax, dim=-1).values
        kth = values.gather(1, (k.clamp(max=kmax) - 1)[:, None]).squeeze(1)
        return torch.where(t.top_k > 0, kth, float("-inf"))
    xs = x.sort(dim=-1, descending=True).values
    in_k = torch.arange(V, device=x.device)[None, :] < k[:, None]
    ps = xs.masked_fill(~in_k, float("-inf")).softmax(-1)  # top-p acts on the top-k renormalised
    mass_before = F.pad(ps.cumsum(-1)[:, :-1], (1, 0))     # shifted cumsum: monotone, exactly 0 first
    top_p = t.top_p[:, None]
    # p = 1 keeps all: the fp32 cumsum can reach 1.0 before the tail and would drop tiny tokens
    keep = in_k & ((mass_before < top_p) | (top_p >= 1))   # a prefix; rank 0 always kept ...
    keep[:, 0] = True                                       # ... even if a row's top_p underflowed to 0
    return xs.gather(1, (keep.sum(-1) - 1)[:, None]).squeeze(1)


class Sampler:
    """Owns the unseeded generator (one per device, seeded from ``seed`` or from OS entropy) and one
    reusable generator per device that is reseeded for each seeded row (launches capture the seed and
    offset by value, so reseeding after a launch cannot change it)."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_row: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, per_row: bool) -> torch.Generator:
        table = self._per_row if per_row else self._shared
        g = table.get(device)
        if g is None:
            g = table[device] = torch.Generator(device=device)
            if not per_row:  # the per-row one is reseeded before every use
                if self._seed is None:
                    g.seed()
                else:
                    g.manual_seed(self._seed)
        return g

    def generator(self, device: torch.device) -> torch.Generator:
        """The shared (unseeded-rows) generator of ``device``: what rejection sampling of drafts draws from."""
        return self._generator(device, per_row=False)

    @staticmethod
    def probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The distribution each non-greedy row draws from, ``[B, V]`` fp32: softmax(logits / T) over the
        top-k tokens, then over the smallest prefix of those (by probability) whose renormalised mass is
        >= top_p, ties at either cut kept. Greedy rows get softmax(logits) (unused)."""
        x = logits / t.temperature[:, None]
        if t.any_top_p or t.max_top_k:
            x = x.masked_fill(x < _keep_threshold(x, t)[:, None], float("-inf"))
        return x.softmax(-1)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams] | SamplingTensors,
               steps: Sequence[int] | None = None, sample_indices: Sequence[int] | None = None
               ) -> SampleResult:
        """``logits: [B, V]`` fp32 (raw, on any device); ``params``: one per row, or their cached
        ``SamplingTensors``; ``steps[i]``: row i's generation step and ``sample_indices[i]`` its sample
        index, read only for seeded rows. Returns token ids, and logprobs computed from the RAW logits
        (before temperature, top-k and top-p), as OpenAI and vLLM report them. No host sync."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
        B, device = logits.shape[0], logits.device
        if sample_indices is not None and len(sample_indices) != B:
            raise ValueError(f"sample_indices must have {B} entries, got {len(sample_indices)}")
        if not isinstance(params, SamplingTensors) and all(p.greedy for p in params):
            # every row greedy: the argmax and the raw-logit logprobs; no per-row parameter tensors to build
            # and upload (what the other path would compute for these rows, bit for bit)
            if len(params) != B:
                raise ValueError(f"params must describe the {B} rows of logits on {device}, got {len(params)}")
            ids = logits.argmax(-1)
            return SampleResult(ids, *token_logprobs(logits, ids, max((p.logprobs or 0 for p in params), default=0)))
        t = params if isinstance(params, SamplingTensors) else SamplingTensors.build(params, device)
        if t.temperature.shape != (B,) or t.temperature.device != device:
            raise ValueError(f"params must describe the {B} rows of logits on {device}, "
                             f"got {tuple(t.temperature.shape)} on {t.temperature.device}")
        if t.seeded and (steps is None or len(steps) != B):
            raise ValueError(f"steps must give the generation step of each of the {B} rows when a row is seeded")

        ids = logits.argmax(-1) if t.any_greedy else None
        if not t.all_greedy:
            probs = self.probs(logits, t)
            noise = torch.empty_like(probs)
            if t.any_unseeded:
                noise.exponential_(generator=self._generator(device, per_row=False))
            if t.seeded:
                g = self._generator(device, per_row=True)
                for row, seed in t.seeded:
                    g.manual_seed(row_seed(seed, steps[row], sample_indices[row] if sample_indices else 0))
                    noise[row].exponential_(generator=g)
            # E = 0 would make a filtered token 0/0 = NaN, which argmax prefers
            sampled = probs.div_(noise.clamp_min_(_TINY)).argmax(-1)
            ids = sampled if ids is None else torch.where(t.greedy, ids, sampled)
        chosen, top_ids, top_lp = token_logprobs(logits, ids, t.max_logprobs)
        return SampleResult(ids, chosen, top_ids, top_lp)


def stop_check(text_so_far: str, new_text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Append ``new_text`` and look for a stop string, including one that began in ``text_so_far``
    (which, checked at earlier steps, holds none). Returns the whole text cut before the earliest
    stop string (OpenAI excludes it) and whether one was found. The cut can fall inside
    ``text_so_far``; a streamer that emits only ``text[:len(text) - stop_holdback(text, stop)]``
    never has to take back text it sent."""
    text = text_so_far + new_text
    first = -1
    for s in stop if new_text else ():
        i = text.find(s, max(0, len(text_so_far) - len(s) + 1))  # matches that reach into new_text
        if i >= 0 and (first < 0 or i < first):
            first = i
    return (text, False) if first < 0 else (text[:first], True)


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: the characters
    a streamer must hold back until the next token decides whether they start a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
