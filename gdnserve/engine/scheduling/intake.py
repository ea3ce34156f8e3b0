"""Requests at the public boundary: tokenized, validated and checked against the engine's capacity before they
are queued. A request that can never fit (``n`` samples beyond ``max_num_seqs`` or the state slots, or the KV
pages of ``n × (prompt + max_tokens)`` tokens, the prompt's shared pages counted once, beyond the pool) is refused
here with the numbers, never admitted to wait forever. Pure functions of the frozen config: safe to call from any
thread."""
from __future__ import annotations

from array import array

import numpy as np

from gdnserve.engine.cache.checkpoint_index import INT32
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.detokenizer import IncrementalDetokenizer
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.engine.scheduling.request import Request, RequestError, Sample, ScoreJob


def _token_ids(prompt, vocab_size: int) -> tuple[list[int], bytes]:
    """A token-id prompt as Python ints and as native int32 bytes (the checkpoint keys of its prefixes hash
    them), converted and checked at C speed (a 600-token prompt per request, 160 requests a serving pass: the
    per-token Python check cost ~10 % of a grouped pass's wall time on the H200 host)."""
    try:
        a = array(INT32, prompt)
    except (TypeError, OverflowError) as e:
        raise RequestError(f"prompt has token ids outside the vocabulary 0..{vocab_size - 1} or not ints ({e})") \
            from None
    if len(a):
        v = np.frombuffer(a, dtype=np.int32)
        if int(v.min()) < 0 or int(v.max()) >= vocab_size:
            raise RequestError(f"prompt has token ids outside the vocabulary 0..{vocab_size - 1}")
    return a.tolist(), a.tobytes()


def _pages(cfg: EngineConfig, tokens: int) -> int:
    return -(-tokens // cfg.page_size)


def fork_pages(cfg: EngineConfig, prompt: int, max_tokens: int, n: int, shared: int) -> int:
    """KV pages, at most, of n samples forked from a producer of the first ``shared`` prompt tokens: the producer
    holds the prefix's pages, the samples share its full ones and each holds the rest of its own sequence (the
    partial page copied) up to prompt + max_tokens tokens. (Admission takes an automatic hit for n > 1 samples
    only where this fits the pool: a short shared prefix can need more than the request was admitted for.)"""
    return _pages(cfg, shared) + n * (_pages(cfg, prompt + max_tokens) - shared // cfg.page_size)


def _sample_pages(cfg: EngineConfig, prompt: int, max_tokens: int, n: int, checkpoint_at: int | None
                  ) -> tuple[int, int]:
    """(KV pages the n samples of a request need at most, the prompt tokens whose pages they share). n > 1 samples
    fork at its marker or, without one (or when they ignore it for prompt logprobs, or are recomputed after a
    preemption), at the prompt minus its last token: the larger need counts."""
    if n == 1 or prompt == 1:
        return n * _pages(cfg, prompt + max_tokens), 0
    forks = {prompt - 1} | ({checkpoint_at} if checkpoint_at else set())
    return max((fork_pages(cfg, prompt, max_tokens, n, s), s) for s in forks)


def make_request(cfg: EngineConfig, tokenizer, vocab_size: int, request_id: str, prompt: str | list[int],
                 params: SamplingParams, checkpoint_at: int | None = None) -> Request:
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    i32 = None
    if isinstance(prompt, str):
        ids, marker_at = tokenizer.encode_with_marker(prompt)
        if marker_at is not None and checkpoint_at is not None and marker_at != checkpoint_at:
            raise RequestError(f"checkpoint_at={checkpoint_at} disagrees with the marker at token {marker_at}")
        checkpoint_at = marker_at if marker_at is not None else checkpoint_at
    else:
        ids, i32 = _token_ids(prompt, vocab_size)
    if not ids:
        raise RequestError("prompt is empty")
    if i32 is None:                           # a tokenized prompt (ids from a list were checked above)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RequestError(f"prompt has token ids outside the vocabulary 0..{vocab_size - 1}")
        i32 = array(INT32, ids).tobytes()
    if len(ids) + params.max_tokens > cfg.max_model_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                           f"context length {cfg.max_model_len}")
    if params.prompt_logprobs is not None and len(ids) > cfg.max_step_tokens and (
            params.n > 1 or checkpoint_at is not None):
        # a single-sample prompt is prefilled (and scored) chunk by chunk; n samples' fork or a marked prefix run in
        # one step keeping every position's logits: the memory plan prices steps of max_step_tokens rows, no more
        raise RequestError(f"prompt_logprobs: a prompt of {len(ids)} tokens with n > 1 or a checkpoint marker runs "
                           f"in one step with every position's logits, more than max_step_tokens = "
                           f"{cfg.max_step_tokens} (--max-step-tokens), the largest step the memory plan prices",
                           "prompt_logprobs")
    if checkpoint_at is not None and not 0 < checkpoint_at < len(ids):
        raise RequestError(f"checkpoint_at must be inside the prompt (0 < c < {len(ids)}), got {checkpoint_at}")
    n = params.n
    if n > cfg.max_num_seqs:
        raise RequestError(f"n: {n} samples exceed max_num_seqs = {cfg.max_num_seqs} (the engine's concurrently "
                           "running sequences)", "n")
    if n + 1 > cfg.slots:
        raise RequestError(f"n: {n} samples (+1 for their fork) need {n + 1} state slots, the pool has {cfg.slots}",
                           "n")
    need, shared = _sample_pages(cfg, len(ids), params.max_tokens, n, checkpoint_at)
    if need > cfg.pages:
        raise RequestError(f"n x (prompt + max_tokens) = {n} x ({len(ids)} + {params.max_tokens}) tokens need "
                           f"{need} KV pages of {cfg.page_size}"
                           f"{f' (sharing the first {shared} prompt tokens)' if shared else ''}, the pool has "
                           f"{cfg.pages}; send fewer samples or a smaller max_tokens", "n")
    return Request(request_id, ids, params, checkpoint_at,
                   [Sample(i, IncrementalDetokenizer(tokenizer)) for i in range(n)], prompt_i32=i32)


def make_score_job(cfg: EngineConfig, tokenizer, vocab_size: int, request_id: str, prefix: str | list[int],
                   candidates: list[str | list[int]], label_token_ids: list[int] | None = None) -> ScoreJob:
    enc = lambda x: tokenizer.encode(x) if isinstance(x, str) else list(x)  # noqa: E731
    p_ids = enc(prefix)
    c_ids = [enc(c) for c in candidates]
    if not p_ids:
        raise RequestError("prefix is empty", "prefix")
    if not c_ids:
        raise RequestError("candidates is empty", "candidates")
    for i, c in enumerate(c_ids):
        if not c:
            raise RequestError(f"candidates[{i}] is empty", f"candidates[{i}]")
        if len(p_ids) + len(c) + 1 > cfg.max_model_len:   # + the next token, whose label probabilities it gives
            raise RequestError(f"candidates[{i}]: prefix + candidate ({len(p_ids)} + {len(c)} tokens) and the next "
                               f"token exceed the context length {cfg.max_model_len}", f"candidates[{i}]")
        if len(c) + 1 > cfg.max_step_tokens:     # a candidate runs in one step with every row's logits
            raise RequestError(f"candidates[{i}]: the last prefix token + candidate ({len(c) + 1} tokens) run in one "
                               f"step with every row's logits, more than max_step_tokens = {cfg.max_step_tokens} "
                               "(--max-step-tokens), the largest step the memory plan prices", f"candidates[{i}]")
        need = _pages(cfg, len(p_ids) + len(c) + 1) + 1
        if need > cfg.pages:
            raise RequestError(f"candidates[{i}]: prefix ({len(p_ids)} tokens) + candidate ({len(c)}) need {need} KV "
                               f"pages of {cfg.page_size}, the pool has {cfg.pages}", f"candidates[{i}]")
    labels = list(label_token_ids or [])
    bad = [t for t in labels if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad or any(not 0 <= t < vocab_size for c in [p_ids, *c_ids] for t in c):
        raise RequestError(f"label_token_ids / token ids outside the vocabulary 0..{vocab_size - 1}: {bad[:4]}",
                           "label_token_ids" if bad else None)
    if len(set(labels)) != len(labels):     # one probability per label: label_probs would silently merge them
        raise RequestError(f"label_token_ids holds a token id twice: {labels}", "label_token_ids")
    return ScoreJob(request_id, p_ids, c_ids, labels or None, list(range(len(c_ids))), [None] * len(c_ids))
