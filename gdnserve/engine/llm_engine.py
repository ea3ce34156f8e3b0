"""The engine loop: continuous batching of prefills and decodes over the ModelRunner, with
application-directed checkpoints paired into the same step.

Each ``step()`` schedules every running sample's next decode token, then admits waiting requests FIFO
while slots, pages and the token budget allow. A request that names a checkpoint boundary (a marker in
its text or ``checkpoint_at``) is split there: the prefix becomes a *producer* segment and the rest a
*consumer* of it in the same step; later requests in the same scheduling pass with the same prefix join
as consumers of that producer (the prefix is computed once). ``n > 1`` samples of one prompt fork the
same way from the prompt minus its last token. The step's logits go through one vectorised sampler call.

A published checkpoint becomes READY after its step and stays in the CheckpointIndex with its KV pages:
later requests with the same prefix start from it (state read in place, full KV pages shared, the partial
tail page copied) until LRU eviction under slot or page pressure frees it.

Automatic checkpoints (on by default): a finished request's state and pages are published at exactly the
tokens it consumed, and a new prompt without a marker starts from the READY checkpoint of its longest proper
prefix — the next turn of a chat, or a resend that extends an earlier prompt.

A plain prompt longer than the step's token budget is prefilled chunk by chunk over several steps (its GDN
state and KV carried in its running slot, other requests decoding meanwhile); sampling starts after its last chunk.
So is a checkpoint producer longer than a step (prefix + continuation): its prefix's chunks run into the reserved
checkpoint slot (and the checkpoint's KV pages) while the index entry stays PENDING; the step after its last chunk,
when the checkpoint is READY, the request's samples continue from it. Requests naming the same prefix meanwhile
wait in the queue (skipped by admission, which goes on with the requests behind them) and are admitted as READY
hits once it is published; if the producer is aborted or preempted, the PENDING entry is dropped and the first
waiter becomes the new producer. While chunks continue, admissions stay within the step budget: new requests may
take up to half of it, the chunks get the rest (at least MIN_CHUNK each).

Under KV-page pressure, READY checkpoints are evicted and then the newest requests preempted (every sample's
state slot and pages freed) and later recomputed — n > 1 samples forking from the prompt again, each re-prefilling
its own output so far — so a step never fails for lack of pages and outputs are unchanged.

Speculative decoding (``spec_k > 0``): single-sample requests verify k drafts per step (docs/spec_decode.md),
n-gram drafts proposed here on the host or, with ``spec_draft="mtp"``, the model's MTP head drafting inside the
runner's step on the device; either way acceptance reads them as one device tensor.
Decode-only and verify-only steps replay bucketed CUDA graphs on CUDA devices (engine/cuda_graphs.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from gdnserve.engine.engine_api import (CandidateScore, CheckpointInfo, CompletionOutput, RequestOutput,
                                        ScoreResult)
from gdnserve.engine.checkpoint_index import Checkpoint, CheckpointIndex, CheckpointStatus
from gdnserve.engine.model_runner import ModelRunner, PrefillItem, RunnerConfig, SeqState
from gdnserve.engine.page_pool import PageTable
from gdnserve.engine.sampler import Sampler, SamplingTensors, stop_check, stop_holdback, token_logprobs
from gdnserve.engine.spec.acceptance import emitted_tokens, greedy_accept, rejection_sample
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.engine.spec.ngram import NgramDrafter


def _stable(text: str, stop) -> str:
    """The part of an unfinished sample's text that can no longer change: without a trailing partial
    UTF-8 character (shown as U+FFFD until its last byte arrives) and without a suffix that may still
    grow into a stop string. Streamed text therefore never shrinks."""
    end = len(text) - (stop_holdback(text, stop) if stop else 0)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return text[:end]


MIN_CHUNK = 32   # smallest prefill chunk of a long prompt, so a busy step still makes progress on it


class RequestError(ValueError):
    """A request the engine refuses; the message names the problem (the server answers 400)."""


@dataclass(eq=False)
class _Sample:
    index: int
    seq: SeqState | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None


@dataclass(eq=False)
class _Producer:
    """A chunked checkpoint producer in flight: the index entry (PENDING while chunks run; READY, with a
    reference held by the request, between its last chunk and the step its samples continue from it) and the
    sequence over the entry's slot that carries the prefix's KV pages."""
    entry: Checkpoint
    seq: SeqState


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    checkpoint_at: int | None
    samples: list[_Sample]
    running: bool = False
    checkpoint: CheckpointInfo = field(default_factory=CheckpointInfo)
    prompt_logprobs: list | None = None
    fed: int = 0                      # prompt tokens scheduled so far (< len(prompt_ids) while chunked)
    prod: _Producer | None = None     # while its checkpoint prefix is prefilled chunk by chunk (fed <= checkpoint_at)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    def __init__(self, model, tokenizer, *, runner: RunnerConfig | None = None, max_num_seqs: int = 64,
                 max_step_tokens: int = 4096, max_model_len: int = 4096, model_name: str = "gdnserve", seed=None,
                 auto_checkpoints: bool = True, spec_k: int = 0, spec_mode: str = "replay",
                 spec_draft: str = "ngram", cuda_graphs: bool | None = None):
        """``cuda_graphs``: decode-only and verify-only steps replay bucketed CUDA graphs (None = the runner
        config's choice, by default on for CUDA devices; False turns them off)."""
        runner = runner or RunnerConfig(num_slots=2 * max_num_seqs + 2)
        if spec_draft not in ("ngram", "mtp"):
            raise ValueError(f"spec_draft must be 'ngram' or 'mtp', got {spec_draft!r}")
        if spec_k < 0:
            raise ValueError(f"spec_k must be >= 0, got {spec_k}")
        if spec_k:
            runner.spec_mode, runner.spec_tokens, runner.spec_draft = spec_mode, spec_k + 1, spec_draft
        if cuda_graphs is not None:
            runner.cuda_graphs = cuda_graphs
        if runner.graph_max_batch is None:
            runner.graph_max_batch = max_num_seqs
        runner.max_model_len = max_model_len
        self.runner = ModelRunner(model, runner)
        self.spec_k = spec_k
        # n-gram drafts are proposed here on the host; MTP drafts inside the runner's step, on the device
        self.drafter = NgramDrafter(spec_k) if spec_k and spec_draft == "ngram" else None
        self.tokenizer = tokenizer
        self.sampler = Sampler(seed)
        self.max_num_seqs, self.max_step_tokens, self.max_model_len = max_num_seqs, max_step_tokens, max_model_len
        self.model_name = model_name
        self.vocab_size = model.cfg.vocab_size
        self.eos = set(tokenizer.eos_token_ids)
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.counters = {"prompt_tokens": 0, "tokens_generated": 0, "requests_finished": 0,
                         "checkpoint_hits": 0, "checkpoints_published": 0, "spec_drafted": 0, "spec_accepted": 0,
                         "preemptions": 0}
        self._ids = itertools.count()
        self.index = CheckpointIndex(self.runner.state)
        self.auto_checkpoints = auto_checkpoints
        self.ckpt_pages: dict[bytes, PageTable] = {}       # READY checkpoint key -> its KV pages
        self.counters["checkpoint_misses"] = {}
        self._pending: list = []                           # (entry, producer seq) published this step
        self._acquired: list = []                          # READY entries read this step
        self._producing: dict[tuple[int, ...], _Request] = {}   # PENDING prefix -> its chunked producer
        self._prod_step: list[tuple[_Request, bool]] = []      # chunked producers in this step (last chunk?)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    checkpoint_at: int | None = None) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            ids, marker_at = self.tokenizer.encode_with_marker(prompt)
            if marker_at is not None and checkpoint_at is not None and marker_at != checkpoint_at:
                raise RequestError(f"checkpoint_at={checkpoint_at} disagrees with the marker at token {marker_at}")
            checkpoint_at = marker_at if marker_at is not None else checkpoint_at
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"prompt has token ids outside the vocabulary 0..{self.vocab_size - 1}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"context length {self.max_model_len}")
        if checkpoint_at is not None and not 0 < checkpoint_at < len(ids):
            raise RequestError(f"checkpoint_at must be inside the prompt (0 < c < {len(ids)}), got {checkpoint_at}")
        req = _Request(request_id, ids, params, checkpoint_at, [_Sample(i) for i in range(params.n)])
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in req.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        self._retire(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        st, pg = self.runner.state, self.runner.pages
        return {"queue_depth": len(self.waiting), "running": len(self.running),
                "state_pool_used": st.num_slots - st.num_free, "state_pool_total": st.num_slots,
                "page_pool_used": pg.num_pages - pg.num_free, "page_pool_total": pg.num_pages,
                "checkpoints_ready": len(self.ckpt_pages), **self.counters}

    def score(self, prefix: str | list[int], candidates: list[str | list[int]],
              label_token_ids: list[int] | None = None) -> ScoreResult:
        """One grouped step: the prefix as producer, every candidate as a consumer of it (the prefix is
        computed once). Per candidate: the summed and mean log-probability of its tokens given the prefix
        and its earlier tokens, and with ``label_token_ids`` the probability of each label as the next token."""
        enc = lambda x: self.tokenizer.encode(x) if isinstance(x, str) else list(x)  # noqa: E731
        p_ids = enc(prefix)
        c_ids = [enc(c) for c in candidates]
        if not p_ids:
            raise RequestError("prefix is empty")
        if not c_ids:
            raise RequestError("candidates is empty")
        for i, c in enumerate(c_ids):
            if not c:
                raise RequestError(f"candidates[{i}] is empty")
            if len(p_ids) + len(c) + 1 > self.max_model_len:
                raise RequestError(f"candidates[{i}]: prefix + candidate exceed the context length {self.max_model_len}")
        bad = [t for t in (label_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad or any(not 0 <= t < self.vocab_size for c in [p_ids, *c_ids] for t in c):
            raise RequestError(f"label_token_ids / token ids outside the vocabulary 0..{self.vocab_size - 1}: {bad[:4]}")
        if self.runner.state.num_free < len(c_ids) + 1:
            raise RequestError(f"score: {len(c_ids) + 1} state slots needed, {self.runner.state.num_free} free; "
                               "retry or send fewer candidates")
        seqs = [self.runner.new_seq() for _ in range(len(c_ids) + 1)]
        try:
            items = [PrefillItem(seqs[0], p_ids)] + [PrefillItem(s, c, producer=0, all_logits=True)
                                                    for s, c in zip(seqs[1:], c_ids)]
            logits = self.runner.step(items, [])
        finally:
            for s in seqs:
                self.runner.free_seq(s)
        # row 0: after the prefix; then each candidate's rows (row j predicts candidate token j + 1)
        out, r = [], 1
        for i, c in enumerate(c_ids):
            pred = torch.cat([logits[0:1], logits[r:r + len(c) - 1]])
            lp, _, _ = token_logprobs(pred, torch.tensor(c, device=logits.device))
            s = float(lp.sum())
            labels = None
            if label_token_ids:
                probs = logits[r + len(c) - 1].softmax(-1)
                labels = {t: float(probs[t]) for t in label_token_ids}
            out.append(CandidateScore(i, s, s / len(c), len(c), labels, CheckpointInfo(hit_length=len(p_ids))))
            r += len(c)
        self.counters["prompt_tokens"] += len(p_ids) + sum(map(len, c_ids))
        self.counters["checkpoint_hits"] += len(c_ids)
        return ScoreResult(p_ids, out)

    # ------------------------------------------------------------------ the step
    def _pages_for_running(self) -> int:
        """KV pages the running requests need this step (decode 1 / verify k+1 tokens, next prefill chunk)."""
        need, ps = 0, self.runner.pages.page_size
        for req in self.running:
            split = req.checkpoint_at
            if req.prod is not None and req.fed < split:          # the producer's next prefix chunk
                need += req.prod.seq.pages.pages_needed(min(split - req.fed, max(self.max_step_tokens, MIN_CHUNK)))
                continue
            if req.prod is not None:        # the samples continue from the READY prefix: tail page copy + tokens
                live = sum(s.finish_reason is None for s in req.samples)
                need += live * (-(-len(req.prompt_ids) // ps) - split // ps)
                continue
            for s in req.samples:
                if s.finish_reason is None and s.seq is not None:
                    n = (min(len(req.prompt_ids) - req.fed, max(self.max_step_tokens, MIN_CHUNK))
                         if req.fed < len(req.prompt_ids) else self.spec_k + 1)
                    need += s.seq.pages.pages_needed(n)
        return need

    def _make_room(self) -> None:
        """Before a step: if the running requests cannot get their KV pages, evict unreferenced READY
        checkpoints, then preempt the most recently admitted requests (every sample's state slot and pages are
        freed; the request is requeued first, to recompute prompt + output so far in ``_readmit``; finished
        samples keep their outputs) — never fail the step."""
        if self._pages_for_running() <= self.runner.pages.num_free:
            return
        self._evict(len(self.ckpt_pages))
        while self._pages_for_running() > self.runner.pages.num_free and len(self.running) > 1:
            victim = self.running[-1]
            self._drop_production(victim)
            self._requeue(victim)
            self.counters["preemptions"] += 1
        # a single running request that still does not fit: nothing left to preempt, the runner will report it

    def step(self) -> list[RequestOutput]:
        self._make_room()
        running_pages = self._pages_for_running()       # before this step's chunks advance `fed`
        decodes, dec_owner, verifies, verified = [], [], [], []
        chunks: list[_Request] = []
        ready: list[tuple[PrefillItem, tuple[_Request, _Sample]]] = []
        for req in self.running:
            if req.prod is not None and req.fed == req.checkpoint_at:
                # its chunked prefix is READY now: the samples continue from it (the held reference is released
                # after this step, like any READY hit's)
                entry, tail = req.prod.entry, req.prompt_ids[req.checkpoint_at:]
                for s in req.samples:
                    ready.append((PrefillItem(s.seq, list(tail), checkpoint=(entry.slot, self.ckpt_pages[entry.key])),
                                  (req, s)))
                self._acquired.append(entry)
                req.prod, req.fed = None, len(req.prompt_ids)
                continue
            if req.fed < len(req.prompt_ids):         # a long prompt (or checkpoint prefix) still being prefilled
                chunks.append(req)
                continue
            for s in req.samples:
                if s.finish_reason is None:
                    if self._speculate(req, s):
                        toks = [s.token_ids[-1]]
                        if self.drafter is not None:
                            toks += self.drafter.propose_padded(req.prompt_ids + s.token_ids, self.spec_k)[0]
                        verifies.append((s.seq, toks))
                        verified.append((req, s))
                    else:
                        decodes.append((s.seq, s.token_ids[-1]))
                        dec_owner.append((req, s))
        budget = (self.max_step_tokens - len(decodes) - len(verifies) * (self.spec_k + 1)
                  - sum(len(it.tokens) for it, _ in ready))
        # Chunks in progress are guaranteed MIN_CHUNK tokens each (or half the budget); new admissions may use the
        # rest and must fit in it; the chunks then take whatever the admissions left.
        rem = [(req.checkpoint_at if req.prod is not None else len(req.prompt_ids)) - req.fed for req in chunks]
        reserve = min(sum(rem), max(budget // 2, MIN_CHUNK * len(chunks))) if chunks else 0
        items, item_owner, temps, left = self._admit(budget - reserve, running_pages, busy=bool(chunks or ready))
        left += reserve
        for it, o in ready:                           # appended after _admit's items: producer indices unchanged
            items.append(it)
            item_owner.append(o)
        for req, r in zip(chunks, rem):               # continue chunked prompts (OWN_SLOT continuation)
            fed = req.fed
            n = min(r, max(left, MIN_CHUNK))
            req.fed += n
            left -= n
            if req.prod is not None:                  # a checkpoint prefix: into the PENDING checkpoint's slot
                items.append(PrefillItem(req.prod.seq, req.prompt_ids[fed:fed + n]))
                item_owner.append(None)
                self._prod_step.append((req, n == r))
                continue
            smp = req.samples[0]
            items.append(PrefillItem(smp.seq, req.prompt_ids[fed:fed + n]))
            item_owner.append((req, smp) if req.fed == len(req.prompt_ids) else None)
        if not items and not decodes and not verifies:
            return []
        try:
            logits = self.runner.step(items, decodes, is_ready=lambda s: not self.index.is_writable(s),
                                      verifies=verifies)
        except BaseException:
            self._after_step(temps, ok=False)
            raise
        self._after_step(temps, ok=True)
        # logits rows: one per item (all of its tokens for all_logits items), then one per decode
        first, r = [], 0
        for it in items:
            first.append(r)
            r += len(it.tokens) if it.all_logits else 1
        last = [f + (len(it.tokens) - 1 if it.all_logits else 0) for f, it in zip(first, items)]
        self._prompt_logprobs(items, item_owner, first, logits)
        rows = [last[i] for i, o in enumerate(item_owner) if o is not None] + [r + j for j in range(len(decodes))]
        owners = [o for o in item_owner if o is not None] + dec_owner
        touched = {id(r): r for r, _ in owners}
        touched.update({id(r): r for r, _ in verified})
        if rows:
            self._sample(logits[torch.tensor(rows, device=logits.device)], owners)
        if verified:
            self._accept_verified(logits[r + len(decodes):], verified)
        outs = []
        for req in touched.values():
            if req.finished:
                self._retire(req)
            outs.append(self._output(req))
        return outs

    def _admit(self, budget: int, running_pages: int, busy: bool = False):
        """Admit waiting requests in arrival order while slots, pages and ``budget`` allow; the first that does
        not fit stops the pass. A request whose checkpoint prefix is being produced by a chunked producer
        (PENDING) is skipped — it waits in place for the READY checkpoint — and the pass goes on behind it.
        ``busy``: the step already has prefill work (chunks in progress), so even the first admission must fit
        ``budget``. Returns the items, their owners, the step's temporary sequences and the budget left."""
        self._running_pages, self._admitted_pages = running_pages, 0
        items: list[PrefillItem] = []
        owner: list[tuple[_Request, _Sample] | None] = []
        temps: list[SeqState] = []
        producers: dict[tuple[int, ...], int] = {}
        free_slots = self.runner.state.num_free
        ps = self.runner.pages.page_size
        pos = 0
        while pos < len(self.waiting):
            req = self.waiting[pos]
            if any(s.token_ids for s in req.samples):    # a preempted request: recompute its tokens so far
                cost = self._readmit(req, items, owner, temps, budget, free_slots, busy)
                if cost is None:
                    break
                budget -= cost
                free_slots = self.runner.state.num_free   # its sequences are allocated; evictions may have freed some
                continue
            n, ids, c = len(req.samples), req.prompt_ids, req.checkpoint_at
            hit = None
            auto = self._longest_hit(ids) if c is None and self.auto_checkpoints else None
            if auto is not None:                 # an earlier request's state covers a prefix of this prompt
                split, hit, miss = auto.length, auto, None
            else:
                split = c if c is not None else (len(ids) - 1 if n > 1 and len(ids) > 1 else None)
            key = tuple(ids[:split]) if split else None
            if c is not None and key not in producers and key in self._producing:
                pos += 1                         # its checkpoint is PENDING (a chunked producer): wait for READY
                continue
            if c is not None and key not in producers:
                look = self.index.lookup(key)
                hit = look.entry if look.hit else None
                miss = None if look.hit else look.reason.value
            if hit is not None:
                self.index.acquire(hit)          # pinned now, so the evictions below cannot take it
                self._acquired.append(hit)
            new_producer = key is not None and key not in producers and hit is None
            cost = (len(ids) if split is None else len(ids) - split) * n + (split if new_producer else 0)
            need = n + (1 if new_producer else 0)
            seqs_now = self._live_seqs()
            pages = (cost + (n + 1) * ps) // ps + n + 1
            if hit is not None:     # consumers of a READY checkpoint: the copied tail page, their tokens, a decode
                pages = n * (-(-len(ids) // ps) - split // ps + 1)
            if need > free_slots and self._evict(need - free_slots):
                free_slots = self.runner.state.num_free
            if pages > self._page_room():
                self._evict(len(self.ckpt_pages))
            chunk = prod_chunk = None
            if cost > max(budget, MIN_CHUNK) and need <= free_slots and req.params.prompt_logprobs is None:
                if key is None and n == 1:
                    chunk = max(budget, MIN_CHUNK)       # a long plain prompt: prefill its first chunk now
                    cost = chunk
                    pages = chunk // ps + 2
                elif new_producer and c is not None and (busy or cost > self.max_step_tokens):
                    # a checkpoint producer too long for any step (or a step busy with chunks): its prefix runs
                    # chunk by chunk into the PENDING checkpoint, the samples continue from it once it is READY.
                    # One that fits a step waits for one instead, to run with its same-pass consumers.
                    prod_chunk = min(split, max(budget, MIN_CHUNK))
                    cost = prod_chunk
                    pages = split // ps + 2      # admitted only when the whole prefix fits: not preempted for it
            if (need > free_slots or seqs_now + n > self.max_num_seqs or ((items or busy) and cost > budget)
                    or pages > self._page_room()):
                if hit is not None:
                    self._acquired.remove(hit)
                    self.index.release(hit)
                    if not self.running and not items and hit.refcount == 0:
                        # nothing runs that could free room and the checkpoint itself takes it: drop it (with
                        # every unreferenced checkpoint) and take the request again as a miss, never wait forever
                        self._evict(len(self.ckpt_pages))
                        continue
                break
            self.waiting.pop(pos)
            ckpt_item = None
            if new_producer:
                if c is not None:       # publish the prefix as a checkpoint: PENDING now, READY after the step
                    entry = self.index.reserve(key)
                    prod = SeqState(entry.slot, PageTable(self.runner.pages))
                    req.checkpoint = CheckpointInfo(hit_length=0, miss_reason=miss, published=True)
                    self.counters["checkpoints_published"] += 1
                    self.counters["checkpoint_misses"][miss] = self.counters["checkpoint_misses"].get(miss, 0) + 1
                    if prod_chunk is not None:       # READY after its last chunk's step (_after_step)
                        req.prod = _Producer(entry, prod)
                        self._producing[key] = req
                        self._prod_step.append((req, prod_chunk == split))
                    else:
                        self._pending.append((entry, prod))
                else:
                    prod = self.runner.new_seq()
                    temps.append(prod)
                if prod_chunk is None:
                    producers[key] = len(items)
                items.append(PrefillItem(prod, list(key[:prod_chunk]),
                                         all_logits=req.params.prompt_logprobs is not None))
                owner.append(None)
            elif hit is not None:                           # acquired above; released after the step
                ckpt_item = (hit.slot, self.ckpt_pages[hit.key])
                req.checkpoint = CheckpointInfo(hit_length=split)
                self.counters["checkpoint_hits"] += 1
            elif key is not None:
                req.checkpoint = CheckpointInfo(hit_length=split)
                self.counters["checkpoint_hits"] += c is not None
            want_all = req.params.prompt_logprobs is not None
            req.fed = chunk if chunk is not None else prod_chunk if prod_chunk is not None else len(ids)
            for s in req.samples:
                s.seq = self.runner.new_seq()
                if chunk is not None:
                    items.append(PrefillItem(s.seq, list(ids[:chunk])))
                    owner.append(None)                  # no token is sampled until the last chunk
                    continue
                if prod_chunk is not None:
                    continue                            # the slot waits for the READY prefix
                if key is None:
                    items.append(PrefillItem(s.seq, list(ids), all_logits=want_all))
                elif ckpt_item is not None:
                    items.append(PrefillItem(s.seq, list(ids[split:]), checkpoint=ckpt_item, all_logits=want_all))
                else:
                    items[producers[key]].all_logits |= want_all
                    items.append(PrefillItem(s.seq, list(ids[split:]), producer=producers[key], all_logits=want_all))
                owner.append((req, s))
            free_slots -= need
            budget -= cost
            self._admitted_pages += pages
            req.running = True
            self.running.append(req)
            self.counters["prompt_tokens"] += len(ids)
        return items, owner, temps, budget

    def _live_seqs(self) -> int:
        """Unfinished samples of the running requests (what ``max_num_seqs`` bounds)."""
        return sum(1 for r in self.running for s in r.samples if s.finish_reason is None)

    def _page_room(self) -> int:
        """KV pages new admissions may take this step: free pages minus what the running requests need
        (computed at the start of the admission pass) and what this pass has already promised."""
        return self.runner.pages.num_free - self._running_pages - self._admitted_pages

    def _readmit(self, req: _Request, items, owner, temps, budget: int, free_slots: int,
                 busy: bool = False) -> int | None:
        """Recompute a preempted request: every unfinished sample's state after prompt + its output minus the
        last token (whose logits are not needed: the next step decodes that token). Several unfinished samples
        fork as on first admission: a producer prefills the prompt minus its last token once (a temporary, freed
        after the step) and each sample continues it with the last prompt token + its own output; a single one
        is one plain prefill. Finished samples keep their outputs. Seeded samples continue their random stream
        unchanged (a row's noise depends only on seed, sample index and token count). Returns the tokens of the
        step budget it takes, or None (nothing changed) when it does not fit now."""
        live = [s for s in req.samples if s.finish_reason is None]
        prompt, ps = req.prompt_ids, self.runner.pages.page_size
        fork = len(live) > 1 and len(prompt) > 1
        head = prompt[:-1] if fork else []
        tails = [(prompt[-1:] if fork else prompt) + s.token_ids[:-1] for s in live]
        cost = len(head) + sum(map(len, tails))
        need = len(live) + fork
        # a tail's pages: its copied partial page, its tokens, the next decode's token
        pages = (len(head) // ps + 1 if fork else 0) + sum(len(t) // ps + 2 for t in tails)
        seqs_now = self._live_seqs()
        if need > free_slots and self._evict(need - free_slots):
            free_slots = self.runner.state.num_free
        if pages > self._page_room():
            self._evict(len(self.ckpt_pages))
        if (need > free_slots or seqs_now + len(live) > self.max_num_seqs or ((items or busy) and cost > budget)
                or pages > self._page_room()):
            return None
        self.waiting.remove(req)
        producer = -1
        if fork:
            prod = self.runner.new_seq()
            temps.append(prod)
            producer = len(items)
            items.append(PrefillItem(prod, head))
            owner.append(None)
        for s, toks in zip(live, tails):
            s.seq = self.runner.new_seq()
            items.append(PrefillItem(s.seq, toks, producer=producer))
            owner.append(None)                           # nothing is sampled: the next step decodes the last token
        self._admitted_pages += pages
        req.fed, req.running = len(prompt), True
        self.running.append(req)
        return cost

    def _prompt_logprobs(self, items, owner, first, logits) -> None:
        """Fill ``prompt_logprobs`` of requests that asked (their items ran with all_logits): token j + 1 of the
        prompt from the row of token j; the first token has none, nor does a prefix read from a READY checkpoint
        (only its state is kept), nor the first token after it (its logits were the checkpoint's last row)."""
        for i, (it, o) in enumerate(zip(items, owner)):
            if o is None or not it.all_logits or o[1].index != 0:
                continue
            req = o[0]
            k = req.params.prompt_logprobs
            rows: list[int] = []
            if it.producer >= 0:                                 # the prefix's rows come from the producer
                p = items[it.producer]
                rows += range(first[it.producer], first[it.producer] + len(p.tokens))
            rows += range(first[i], first[i] + len(it.tokens) - 1)
            lead = len(req.prompt_ids) - 1 - len(rows)           # positions covered only by a READY checkpoint
            # row r predicts prompt token lead + r + 1
            lp, ids, vals = token_logprobs(logits[torch.tensor(rows, device=logits.device)],
                                           torch.tensor(req.prompt_ids[lead + 1:], device=logits.device), k)
            lp = lp.tolist()
            top = (ids.tolist(), vals.tolist()) if ids is not None else None
            out: list[dict[int, float] | None] = [None] * (lead + 1)
            for j, tok in enumerate(req.prompt_ids[lead + 1:]):
                d = {tok: lp[j]}
                if top is not None:
                    d.update(zip(top[0][j], top[1][j]))
                out.append(d)
            req.prompt_logprobs = out

    def _after_step(self, temps: list[SeqState], ok: bool) -> None:
        """Producers of n-sample forks live for one step; published checkpoints become READY (their state
        and KV pages are final once the step has run) — or are dropped if the step failed; references taken
        for the step are released."""
        for seq in temps:
            self.runner.free_seq(seq)
        for entry, prod in self._pending:
            if ok:
                self.index.mark_ready(entry)
                self.ckpt_pages[entry.key] = prod.pages
            else:
                self.index.abort(entry)
                prod.pages.release()
        for entry in self._acquired:
            self.index.release(entry)
        self._pending, self._acquired = [], []
        prods, self._prod_step = self._prod_step, []
        for req, last in prods:
            if not ok:
                # the PENDING prefix may be half written: drop it and recompute the request from the start
                # (an aborted request is simply gone); waiters then find no checkpoint and one of them produces it
                self._drop_production(req)
                self._requeue(req)
            elif last:          # the prefix is complete: READY, pinned by the request until its samples read it
                entry = req.prod.entry
                self.index.mark_ready(entry)
                self.index.acquire(entry)
                self.ckpt_pages[entry.key] = req.prod.seq.pages
                self._producing.pop(entry.token_ids, None)

    def _drop_production(self, req: _Request) -> None:
        """Give up a chunked producer's checkpoint (abort, preemption, failed step): a PENDING entry is dropped
        with its KV pages, so requests waiting for it find no checkpoint and one of them produces it; a READY one
        stays published, only the request's reference is released."""
        p, req.prod = req.prod, None
        if p is None:
            return
        if p.entry.status is CheckpointStatus.PENDING:
            if self._producing.get(p.entry.token_ids) is req:
                del self._producing[p.entry.token_ids]
            self.index.abort(p.entry)
            p.seq.pages.release()
            # it was never published: undo its admission's counts (its next producer counts them)
            self.counters["checkpoints_published"] -= 1
            miss = req.checkpoint.miss_reason
            if self.counters["checkpoint_misses"].get(miss):
                self.counters["checkpoint_misses"][miss] -= 1
            req.checkpoint = CheckpointInfo()
        elif p.entry.status is CheckpointStatus.READY:
            self.index.release(p.entry)

    def _free_samples(self, req: _Request) -> None:
        """Free every sample's state slot and KV pages."""
        for s in req.samples:
            if s.seq is not None:
                self.runner.free_seq(s.seq)
                s.seq = None

    def _requeue(self, req: _Request) -> None:
        """Back to the front of the queue with nothing allocated (preemption, failed producer step)."""
        self._free_samples(req)
        req.fed, req.running = 0, False
        if req in self.running:
            self.running.remove(req)
        if req not in self.waiting:
            self.waiting.insert(0, req)

    def _evict(self, n: int) -> bool:
        """Evict up to n unreferenced READY checkpoints (LRU), freeing their state slots and KV pages."""
        gone = self.index.evict_lru(n)
        for entry in gone:
            self.ckpt_pages.pop(entry.key).release()
        return bool(gone)

    def _sample(self, logits: torch.Tensor, owners: list[tuple[_Request, _Sample]]) -> None:
        params = [r.params for r, _ in owners]
        res = self.sampler.sample(logits, params, steps=[len(s.token_ids) for _, s in owners],
                                  sample_indices=[s.index for _, s in owners])
        B = len(owners)
        parts = [res.token_ids.double(), res.logprobs.double()]
        if res.top_ids is not None:
            parts += [res.top_ids.double().flatten(), res.top_logprobs.double().flatten()]
        flat = torch.cat(parts).tolist()                       # the step's one device-to-host read
        toks, lps = [int(t) for t in flat[:B]], flat[B:2 * B]
        tops = None
        if res.top_ids is not None:
            k = res.top_ids.shape[1]
            ti, tl = flat[2 * B:2 * B + B * k], flat[2 * B + B * k:]
            tops = ([[int(x) for x in ti[i * k:(i + 1) * k]] for i in range(B)], [tl[i * k:(i + 1) * k] for i in range(B)])
        for i, ((req, s), tok) in enumerate(zip(owners, toks)):
            d = None
            if req.params.logprobs is not None:
                d = {tok: lps[i]}
                if tops is not None:
                    d.update(zip(tops[0][i][:req.params.logprobs], tops[1][i][:req.params.logprobs]))
            self._append(req, s, tok, lps[i], d)

    def _append(self, req: _Request, s: _Sample, tok: int, lp: float | None, d: dict | None) -> None:
        """Add one generated token to a sample and apply the stop rules; a finished sample's sequence is released."""
        p = req.params
        s.token_ids.append(tok)
        if lp is not None:
            s.cumulative_logprob += lp
        if p.logprobs is not None:
            s.logprobs = (s.logprobs or []) + [d]
        self.counters["tokens_generated"] += 1
        new_text = self.tokenizer.decode(s.token_ids)
        s.text, stopped = stop_check(s.text, new_text[len(s.text):], p.stop) if p.stop else (new_text, False)
        if stopped or tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
            s.finish_reason = "stop"
        elif len(s.token_ids) >= p.max_tokens or len(req.prompt_ids) + len(s.token_ids) >= self.max_model_len:
            s.finish_reason = "length"
        if s.finish_reason is not None and s.seq is not None:
            self._release_sample(req, s)

    def _accept_verified(self, logits: torch.Tensor, verified: list) -> None:
        """Accept drafts: greedy requests by exact match with the target's argmax, sampled ones by rejection
        sampling against the sampler's filtered distribution (so their tokens follow the target's
        distribution); each emits its accepted drafts plus one target token, and the state keeps exactly
        those tokens (runner.accept). One device-to-host copy for the batch."""
        B, L, dev = len(verified), self.spec_k + 1, logits.device
        lg = logits.view(B, L, -1)
        drafts = self.runner.drafts                    # [B, k] on the device (n-gram or MTP)
        num = torch.empty(B, dtype=torch.int64, device=dev)
        emitted = torch.empty(B, L, dtype=torch.int64, device=dev)
        greedy = [i for i, (r, _) in enumerate(verified) if r.params.greedy]
        sampled = [i for i, (r, _) in enumerate(verified) if not r.params.greedy]
        for rows, sample in ((greedy, False), (sampled, True)):
            if not rows:
                continue
            ix = torch.tensor(rows, device=dev)
            if sample:
                t = SamplingTensors.build([verified[i][0].params for i in rows for _ in range(L)], dev)
                probs = Sampler.probs(lg[ix].reshape(len(rows) * L, -1), t).view(len(rows), L, -1)
                n, e = rejection_sample(drafts[ix], None, probs, self.sampler._generator(dev, per_row=False))
            else:
                n, e = greedy_accept(drafts[ix], lg[ix].argmax(-1))
            num[ix], emitted[ix] = n, e
        out = emitted_tokens(num, emitted)
        self.runner.accept([(s.seq, len(toks)) for (_, s), toks in zip(verified, out)])
        for (req, s), toks in zip(verified, out):
            self.counters["spec_drafted"] += self.spec_k
            self.counters["spec_accepted"] += len(toks) - 1
            for tok in toks:
                if s.finish_reason is not None:
                    break
                self._append(req, s, tok, None, None)

    def _speculate(self, req: _Request, s: _Sample) -> bool:
        """Single-sample requests without logprobs, stop strings or a seed (a seeded request's tokens are tied to
        per-step generators) verify k drafts per step when room is left."""
        p = req.params
        return (self.spec_k > 0 and (p.greedy or p.seed is None) and len(req.samples) == 1 and p.logprobs is None
                and not p.stop
                and p.max_tokens - len(s.token_ids) > 1
                and len(req.prompt_ids) + len(s.token_ids) + self.spec_k + 1 < self.max_model_len)

    def _release_sample(self, req: _Request, s: _Sample) -> None:
        """Free a finished sample's sequence — or, with automatic checkpoints, publish its state and KV pages
        as a READY checkpoint of exactly the tokens it consumed (prompt + output minus the last, unfed token),
        so the next turn of a conversation or a resend that extends it starts there."""
        seq, s.seq = s.seq, None
        tokens = req.prompt_ids + s.token_ids[:-1]
        self.runner.flush([seq])                           # replay-mode pending tokens land in the slot first
        if (self.auto_checkpoints and len(req.samples) == 1 and s.finish_reason in ("stop", "length")
                and seq.length == len(tokens)):
            entry = self.index.adopt(tokens, seq.slot)
            if entry is not None:
                self.ckpt_pages[entry.key] = seq.pages
                self.counters["checkpoints_published"] += 1
                return
        self.runner.free_seq(seq)

    def _longest_hit(self, ids: list[int]):
        """The READY checkpoint of the longest proper prefix of ``ids``, or None."""
        for L in sorted({p.length for p in self.ckpt_pages.values()}, reverse=True):
            if L < len(ids):
                look = self.index.lookup(ids[:L])
                if look.hit:
                    return look.entry
        return None

    def _retire(self, req: _Request) -> None:
        self._drop_production(req)
        self._free_samples(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.requests.pop(req.request_id, None) is not None:
            self.counters["requests_finished"] += 1

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text if s.finish_reason else _stable(s.text, req.params.stop),
                                 list(s.token_ids), list(s.logprobs) if s.logprobs else None,
                                 s.cumulative_logprob, s.finish_reason) for s in req.samples]
        return RequestOutput(req.request_id, req.prompt_ids, outs, req.finished, req.checkpoint, req.prompt_logprobs)
