"""The scheduler owns the step's life cycle: ``schedule()`` returns the next step's :class:`StepBatch`, and
``update_from_output(batch, out)`` applies what the step did (checkpoints READY, references released, chunked
producers advanced, finished samples published or freed, a failed step rolled back, the ``EngineStats``
counters: this class and its ``Admission`` are their one writer). What goes into a step:

1. make room: if the running requests cannot get their next KV pages, evict unreferenced READY checkpoints,
   then preempt the newest requests (state dropped, requeued first, recomputed on readmission) — one policy;
2. every running sample's decode token or verify tokens (k drafts) and the READY prefix of a finished chunked
   producer: running decodes get their tokens every step;
3. admission of the waiting jobs that fit the step whole, in arrival order within the step's token budget
   (``admission.py``: plain, producer, READY hit, readmission, score wave). A job that does not fit for lack of
   slots or pages waits without blocking the jobs behind it, and so does a long one (set aside for 5.); the
   pass stops when the budget is spent;
4. the next chunk of each long prompt in progress (its state in its own slot, or a checkpoint prefix into the
   PENDING checkpoint), sharing what the admissions left;
5. the long jobs set aside in 3., oldest first, with what the chunks left: score prefixes in production
   continue, and new chunked prefills start while fewer than ``max_partial_prefills`` are in progress.

While chunks continue, admissions may take up to half of the budget and the chunks get the rest (at least
MIN_CHUNK each): a short request queued behind long prompts is admitted in the next step, however many wait,
and the chunked prompts, at most ``max_partial_prefills`` of them, share at least half of every step until they
are done. The scheduler owns the KV cache (pools and checkpoints).
"""
from __future__ import annotations

from dataclasses import replace

from gdnserve.engine.cache.checkpoint_index import (
    CheckpointStatus,
    conversation_key,
    conversation_prefix,
)
from gdnserve.engine.cache.kv_cache import KVCache
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import CheckpointInfo
from gdnserve.engine.scheduling.admission import MIN_CHUNK, Admission, AdmitPass
from gdnserve.engine.scheduling.engine_stats import EngineStats
from gdnserve.engine.scheduling.request import Job, Request, Sample, ScoreJob
from gdnserve.engine.scheduling.step_batch import StepBatch, StepOutput


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCache, drafter=None) -> None:
        self.cfg, self.kv, self.drafter = cfg, kv, drafter
        self.stats = EngineStats()                        # written here and by the admission only
        self.waiting: list[Job] = []
        self.running: list[Request] = []
        self.producing: dict[tuple[int, ...], Job] = {}    # PENDING prefix -> its chunked producer
        self.allowed: set[Job] | None = None              # while isolating a failure: only these run
        self.inflight: dict[Sample, int] = {}             # overlapped loop: samples whose last id is on the device
        self.admission = Admission(self)

    # ------------------------------------------------------------------ queues
    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_seqs(self) -> int:
        """Unfinished samples of the running requests (what ``max_num_seqs`` bounds)."""
        return sum(len(r.live_samples) for r in self.running)

    def runnable(self, job: Job) -> bool:
        return self.allowed is None or job in self.allowed

    # ------------------------------------------------------------------ one step
    def schedule(self, allowed: set[Job] | None = None, inflight: dict[Sample, int] | None = None) -> StepBatch:
        """The next step's batch (``allowed``: while a failure is isolated, only these jobs run). Never raises for
        a step: an error while scheduling comes back as ``batch.error`` with the batch so far, which
        ``update_from_output`` rolls back like a failed forward. ``inflight`` (the overlapped loop): the samples
        of the step still running, each with its row of that step's sampled ids: their next decode reads the id
        on the device (``batch.feed``), one that reaches its length limit with it is not decoded again, and a
        request of theirs back in the queue waits until the id has landed."""
        self.allowed, self.inflight = allowed, inflight or {}
        batch = StepBatch()
        ck = self.kv.checkpoint_cache
        try:
            ck.poll()                             # restores from a lower tier whose copy is done: READY
            self._fill(batch)
            for _ in range(4):   # nothing else to run but restores in flight: wait for them and admit their waiters
                if not (batch.empty and ck.restoring()):
                    break
                ck.poll(wait=True)
                self._fill(batch)
            self._spill_ahead()
        except Exception as e:      # noqa: BLE001  the engine rolls the step back and isolates its culprit
            batch.error = e
            return batch
        if batch.empty and not self.inflight:
            self.stats.idle_steps += 1
        batch.ready = self._ready_slots(batch)
        return batch

    def _spill_ahead(self) -> None:
        """The free-slot watermark (``checkpoint_spill_ahead`` W, a host tier on): after this step's admissions,
        copy the LRU checkpoints down in the background until W state slots and the pages of the running requests
        plus the next waiting request's prompt could be freed without a copy (kv_cache.CheckpointCache.spill_ahead):
        the next hit's restore or admission then evicts for free."""
        w, ck = self.cfg.checkpoint_spill_ahead, self.kv.checkpoint_cache
        if not w or ck.tiers is None or ck.tiers.arena is None:
            return
        nxt = next((j for j in self.waiting if isinstance(j, Request)), None)
        pages = self.pages_for_running() + (self.kv.pages_for(len(nxt.prompt_ids)) if nxt is not None else 0)
        ck.spill_ahead(w, min(pages, self.kv.pages.num_pages))

    def _ready_slots(self, batch: StepBatch) -> frozenset[int]:
        """The READY checkpoint slots among those the step's prefills write or start from: what the plan's
        ownership check needs to know (a READY slot is never a destination; a checkpoint read must be READY)."""
        ck = self.kv.checkpoint_cache
        slots = {it.seq.slot for it in batch.items} | {it.start_from[0] for it in batch.items if it.start_from}
        return frozenset(s for s in slots if s >= 0 and ck.is_ready_slot(s))

    def _fill(self, batch: StepBatch) -> None:
        self.make_room()
        reserved = self.pages_for_running()       # before this step's chunks advance num_computed
        chunks, ready, ready_long = self._collect_running(batch)
        k = self.cfg.spec_k
        budget = (self.cfg.max_step_tokens - len(batch.decodes) - len(batch.verifies) * (k + 1)
                  - sum(len(it.tokens) for it, _ in ready))
        rem = [self._chunk_end(r) - r.num_computed for r in chunks]
        # score prefixes in production are chunks too (they wait in the queue, not in running): the first pass
        # keeps their share, else short arrivals leave them MIN_CHUNK a step (a 1,500-token prefix: 47 steps)
        prods = [j for j in self.waiting if isinstance(j, ScoreJob) and j.prod is not None and self.runnable(j)]
        scores = len(prods)
        rem_all = sum(rem) + sum(max(len(j.prefix_ids) - j.num_computed, MIN_CHUNK) for j in prods)
        reserve = min(rem_all, max(budget // 2, MIN_CHUNK * (len(chunks) + scores))) if chunks or prods else 0
        p = AdmitPass(budget=budget - reserve, reserved=reserved, busy=bool(chunks or ready), live=self.live_seqs(),
                      reserve=reserve, partial=len(chunks) + scores + ready_long)
        self.kv.checkpoint_cache.promised = lambda: p.reserved   # a restore started by a lookup leaves these free
        longs = self.admission.admit_waiting(batch, p)
        for it, o in ready:                       # after the admissions' items: producer indices unchanged
            batch.add(it, o)
        p.budget = self._continue_chunks(batch, chunks, rem, p.budget + p.reserve)
        p.partial = scores + ready_long + sum(r.num_computed < self._chunk_end(r) for r in chunks)   # still chunked
        self.admission.admit_long(batch, p, longs)
        self.kv.checkpoint_cache.promised = None

    def _ready_chunk(self, req: Request) -> int:
        """At most the tail tokens the samples of a chunked producer run in the step its prefix is READY: all of
        them, or for one sample whose tail is longer than half a step, half a step (less when decodes or other READY
        producers take the step: ``_collect_running``; the rest continue as chunks)."""
        tail = len(req.prompt_ids) - req.prod.end
        half = max(self.cfg.max_step_tokens // 2, MIN_CHUNK)
        return min(tail, half) if len(req.samples) == 1 else tail

    @staticmethod
    def _chunk_end(req: Request) -> int:
        return req.prod.end if req.prod is not None else len(req.prompt_ids)

    def _collect_running(self, batch: StepBatch):
        """The running requests' work: decodes added to ``batch``; returns the requests with a next prefill chunk,
        the READY producers' items (not yet added) and how many of those leave a chunked tail behind."""
        chunks: list[Request] = []
        ready = []
        readies: list[Request] = []
        for req in self.running:
            if not self.runnable(req):          # paused while a failure is isolated among others
                continue
            batch.join(req)
            if req.prod is not None and req.num_computed == req.prod.end:
                readies.append(req)             # its chunked prefix is READY now (below, once decodes are known)
            elif req.num_computed < len(req.prompt_ids):
                chunks.append(req)
            else:
                self._decode(req, batch)
        # the samples of a READY producer continue from its checkpoint (the reference it holds is released after
        # this step, like any READY hit's); one sample's tail beyond half of what the decodes leave runs that much
        # from the checkpoint, the rest in chunks on its own slot (_continue_chunks): a partial prefill like them
        left = self.cfg.max_step_tokens - len(batch.decodes) - len(batch.verifies) * (self.cfg.spec_k + 1)
        longs = 0
        for req in readies:
            entry, end = req.prod.entry, req.prod.end
            kv = self.kv.checkpoint_cache.kv_of(entry)
            first = len(req.prompt_ids) - end
            if len(req.samples) == 1:
                first = min(first, self._ready_chunk(req), max(left // 2, MIN_CHUNK))
            whole = end + first == len(req.prompt_ids)
            ready += [(PrefillItem(s.seq, list(req.prompt_ids[end:end + first]), start_from=kv), (req, s) if whole else None)
                      for s in req.samples]
            left -= first * len(req.samples)
            longs += not whole
            batch.acquired.append(entry)
            req.prod, req.num_computed = None, end + first
        return chunks, ready, longs

    def _decode(self, req: Request, batch: StepBatch) -> None:
        for s in req.live_samples:
            row = self.inflight.get(s)
            if row is not None:               # its last id is still on the device
                n = len(s.token_ids) + 1
                if n >= req.params.max_tokens or len(req.prompt_ids) + n >= self.cfg.max_model_len:
                    continue                  # that id is its last (length): nothing more to decode
                batch.feed.append((len(batch.decodes), row))
                batch.decodes.append((s.seq, 0))      # a placeholder: the feed writes the id on the device
                batch.dec_owners.append((req, s))
                continue
            if self.speculates(req, s):
                toks = [s.token_ids[-1]]
                if self.drafter is not None:
                    toks += self.drafter.propose_padded(req.prompt_ids + s.token_ids, self.cfg.spec_k)[0]
                batch.verifies.append((s.seq, toks))
                batch.verified.append((req, s))
            else:
                batch.decodes.append((s.seq, s.token_ids[-1]))
                batch.dec_owners.append((req, s))

    def speculates(self, req: Request, s) -> bool:
        """Single-sample requests without a seed (a seeded request's tokens are tied to per-step generators)
        verify k drafts per step while their verify fits the context; logprobs come from the verify rows, and a
        stop string (like EOS) that ends the sample inside an accepted run drops the tokens after it. One token
        from ``max_tokens`` they verify too (the acceptance keeps what the sample may still emit: one token, its
        state exactly that far): a decode row beside verifies would send the whole step to the eager path."""
        p, k = req.params, self.cfg.spec_k
        return (k > 0 and (p.greedy or p.seed is None) and len(req.samples) == 1
                and len(req.prompt_ids) + len(s.token_ids) + k + 1 < self.cfg.max_model_len)

    def _continue_chunks(self, batch: StepBatch, chunks: list[Request], rem: list[int], left: int) -> int:
        """The next chunk of each long prompt (an OWN_SLOT continuation), or of a checkpoint prefix (into the
        PENDING checkpoint's slot); returns the budget left. ``left`` is shared fairly (water-filling: each
        chunk gets its remainder or an equal part of what the smaller ones left, at least MIN_CHUNK), so that
        with ``max_partial_prefills`` > 1 a shorter long prompt is not stuck behind a much longer one."""
        take = [0] * len(chunks)
        for i, j in enumerate(sorted(range(len(rem)), key=rem.__getitem__)):
            take[j] = min(rem[j], max(left // (len(rem) - i), MIN_CHUNK))
            left -= take[j]
        for req, r, n in zip(chunks, rem, take):
            start = req.num_computed
            req.num_computed += n
            if req.prod is not None:
                batch.add(PrefillItem(req.prod.seq, req.prompt_ids[start:start + n]))
                batch.prod_chunks.append((req, n == r))
                continue
            smp = req.samples[0]
            last = req.num_computed == len(req.prompt_ids)
            want_all = req.params.prompt_logprobs is not None
            idx = batch.add(PrefillItem(smp.seq, req.prompt_ids[start:start + n], all_logits=want_all),
                            (req, smp) if last else None)
            if want_all:
                batch.prompt_chunks.append((idx, req, start, last))
        return left

    # ------------------------------------------------------------------ after the step
    def settle(self, batch: StepBatch) -> None:
        """Settle a step that ran as soon as it is launched (the overlapped loop: before the next step is
        scheduled; device work is stream-ordered, so a later step reads what this one writes)."""
        self._settle(batch, ok=True)

    def update_from_output(self, batch: StepBatch, out: StepOutput) -> None:
        """Everything a finished step changes in the scheduler's state. Always: temporaries freed, the step's
        references released, published checkpoints READY if the forward ran (dropped if not), chunked producers
        advanced. A step that ran and was processed: its counts added, finished samples published as automatic
        checkpoints or freed (the runner flushed them first). A failed step (not a dead engine): every job of
        it requeued, recomputed later from its tokens so far."""
        if not batch.settled:
            self._settle(batch, ok=out.ran)
        if out.error is not None:
            if not out.dead:
                self._roll_back(batch)
            return
        done = out.processed
        st = self.stats
        st.tokens_generated += done.tokens
        st.spec_drafted += done.verified * self.cfg.spec_k
        st.spec_accepted += done.drafts_accepted
        for req, s in done.finished:
            self._publish(req, s)

    def _settle(self, batch: StepBatch, ok: bool) -> None:
        """Producers of n-sample forks and score candidates live for one step; published checkpoints become
        READY (their state and KV pages are final once the step has run) or are dropped if it failed;
        references taken for the step are released; chunked producers advance."""
        ck = self.kv.checkpoint_cache
        batch.settled = True
        for seq in batch.temps:
            self.kv.free_seq(seq)
        for entry, prod in batch.pending:
            (ck.ready if ok else ck.abort)(entry, prod.pages)
        for entry in batch.acquired:
            ck.release(entry)
        batch.temps, batch.pending, batch.acquired = [], [], []
        for job, last in batch.prod_chunks if ok else ():
            if not last:
                continue
            if isinstance(job, Request):   # READY, pinned by the request until its samples read it
                entry, pages = job.prod.entry, job.prod.seq.pages
            else:
                entry, pages, job.prod = job.entry, job.prod.pages, None
            ck.ready(entry, pages)
            ck.acquire(entry)
            self.producing.pop(entry.token_ids, None)

    def _publish(self, req: Request, s: Sample) -> None:
        """A finished sample: an automatic checkpoint of exactly the tokens a single-sample request consumed
        (prompt + output minus the last, unfed token), or freed."""
        seq, s.seq = s.seq, None
        if seq is None:
            return
        tokens = conversation_prefix(req.prompt_ids, s.token_ids)
        if (self.cfg.auto_checkpoints and len(req.samples) == 1 and s.finish_reason in ("stop", "length")
                and seq.length == len(tokens)
                and self.kv.checkpoint_cache.adopt(tokens, seq, conversation_key(req, s.token_ids)) is not None):
            self.stats.checkpoints_published += 1
            req.checkpoint = replace(req.checkpoint, published=True)
            return
        self.kv.free_seq(seq)

    def _roll_back(self, batch: StepBatch) -> None:
        """A failed step: score waves give their candidates back, every unfinished job returns to the queue in the
        step's order with nothing allocated (outputs so far kept)."""
        for w in batch.waves:
            w.job.todo = sorted(set(w.job.todo) | set(w.cands))
        for i, job in enumerate(batch.jobs):
            if not job.finished:        # (overlapped loop: one that finished as the step before landed is gone)
                self.requeue(job, front=i)

    # ------------------------------------------------------------------ pages and preemption
    def pages_for_running(self) -> int:
        """KV pages the running requests need this step (decode 1 / verify k+1 tokens, next prefill chunk)."""
        need, ps = 0, self.kv.page_size
        chunk = max(self.cfg.max_step_tokens, MIN_CHUNK)
        for req in self.running:
            split = req.prod.end if req.prod is not None else None
            if req.prod is not None and req.num_computed < split:      # the producer's next prefix chunk
                need += req.prod.seq.pages.pages_needed(min(split - req.num_computed, chunk))
            elif req.prod is not None:      # the samples continue from the READY prefix: tail page copy + tokens
                need += len(req.live_samples) * (-(-(split + self._ready_chunk(req)) // ps) - split // ps)
            else:
                for s in req.live_samples:
                    if s.seq is not None:
                        n = (min(len(req.prompt_ids) - req.num_computed, chunk)
                             if req.num_computed < len(req.prompt_ids) else self.cfg.spec_k + 1)
                        need += s.seq.pages.pages_needed(n)
        return need

    def make_room(self) -> None:
        """If the running requests cannot get their KV pages: evict unreferenced READY checkpoints, then
        preempt the most recently admitted requests (requeued first, recomputed on readmission; finished
        samples keep their outputs) — never fail the step for pages. A single request too large for the pool
        was refused at submission."""
        pages = self.kv.pages
        if self.pages_for_running() <= pages.num_free:
            return
        self.kv.checkpoint_cache.evict(len(self.kv.checkpoint_cache))
        while self.pages_for_running() > pages.num_free and len(self.running) > 1:
            self.requeue(self.running[-1])
            self.stats.preemptions += 1

    # ------------------------------------------------------------------ giving things back
    def free_samples(self, req: Request) -> None:
        for s in req.samples:
            self.free_sample(s)

    def free_sample(self, s: Sample) -> None:
        """A sample's state slot and KV pages back to the pools (no checkpoint published)."""
        if s.seq is not None:
            self.kv.free_seq(s.seq)
            s.seq = None

    def requeue(self, job: Job, front: int = 0) -> None:
        """Back into the queue (at ``front``) with nothing allocated: preemption, a failed step. Outputs so
        far are kept; the request is recomputed on readmission."""
        if isinstance(job, Request):
            self.drop_production(job)
            self.free_samples(job)
            job.num_computed = 0
            if job in self.running:
                self.running.remove(job)
        else:
            self.drop_score_production(job)
        if job not in self.waiting:
            self.waiting.insert(front, job)

    def drop_production(self, req: Request) -> None:
        """Give up a chunked producer's checkpoint (abort, preemption, failed step): a PENDING entry is dropped
        with its KV pages, so requests waiting for it find no checkpoint and one of them produces it; a READY
        one stays published, only the request's reference is released."""
        p, req.prod = req.prod, None
        if p is None:
            return
        ck = self.kv.checkpoint_cache
        if ck.is_pending(p.entry):
            if self.producing.get(p.entry.token_ids) is req:
                del self.producing[p.entry.token_ids]
            ck.abort(p.entry, p.seq.pages)
            self.stats.unpublished(req.checkpoint.miss_reason)     # never published: its next producer counts
            req.checkpoint = CheckpointInfo()
        elif p.entry.status is CheckpointStatus.READY:
            ck.release(p.entry)

    def drop_score_production(self, job: ScoreJob) -> None:
        """A score job's chunked prefix in production (PENDING) or its held READY prefix."""
        ck = self.kv.checkpoint_cache
        if job.prod is not None and job.entry is not None and ck.is_pending(job.entry):
            self.producing.pop(job.entry.token_ids, None)
            ck.abort(job.entry, job.prod.pages)
            miss, job.checkpoint = job.checkpoint.miss_reason, None
            self.stats.unpublished(miss)                             # never published: undo its counts
        elif job.entry is not None and job.entry.status is CheckpointStatus.READY:
            ck.release(job.entry)
        job.prod, job.entry, job.num_computed = None, None, 0

    def retire(self, job: Job, *, failed: bool, finished: bool) -> None:
        """A job leaves the engine (finished, aborted or ``failed``): removed with what it holds, and counted
        (``finished``: it was the engine's until now, not retired before)."""
        self.stats.requests_failed += failed
        self.remove(job)
        self.stats.requests_finished += finished and isinstance(job, Request)

    def remove(self, job: Job) -> None:
        """Out of every queue with everything it holds (finished, aborted, failed)."""
        if isinstance(job, Request):
            self.drop_production(job)
            self.free_samples(job)
            if job in self.running:
                self.running.remove(job)
        else:
            self.drop_score_production(job)
        if job in self.waiting:
            self.waiting.remove(job)
        if self.allowed is not None:
            self.allowed.discard(job)
