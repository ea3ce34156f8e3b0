"""SamplingParams: the per-request sampling settings, validated once at the public boundary.

Every ``ValueError`` message starts with the offending field's name, so the HTTP layer can answer a 4xx
that names it without parsing anything else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_N = 64
MAX_LOGPROBS = 20
# Below these the float32 sampler would underflow (T -> 0 divides by ~0: inf, then NaN; top_p -> 0 keeps no
# token), so they are normalised to their limits: greedy, and only the most likely token (any top_p below
# 1/vocab keeps exactly that one). vLLM's _SAMPLING_EPS for the temperature.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request.

    ``temperature`` 0 (or below ``MIN_TEMPERATURE``) is greedy (argmax of the raw logits; top-p/top-k/seed are then irrelevant).
    ``top_k`` 0 and ``top_p`` 1 are off; a ``top_p`` below ``MIN_TOP_P`` is ``MIN_TOP_P`` (the top token only). ``logprobs`` is how many top alternatives to return per generated
    token besides the chosen one (0 = only the chosen token's); ``prompt_logprobs`` the same per prompt
    token; None = none. ``stop`` strings are excluded from the returned text; ``stop_token_ids`` end the
    request like EOS does (``ignore_eos`` only disables the model's EOS).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in 1..{MAX_N}, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be null or an int in 0..{MAX_LOGPROBS}, got {v!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be null or an int, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        # frozen: normalise through object.__setattr__ (lists -> tuples, ints -> floats)
        object.__setattr__(self, "temperature", float(t) if t >= MIN_TEMPERATURE else 0.0)
        object.__setattr__(self, "top_p", max(float(p), MIN_TOP_P))
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
