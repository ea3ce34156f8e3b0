"""Admission of waiting jobs into a step, one method per case: a fresh request (plain, checkpoint producer,
consumer of a same-step producer, READY hit, first chunk of a long prompt or prefix), a preempted request's
readmission, a score job's wave. Each case plans its cost (budget tokens, state slots, KV pages from the one
formula ``KVCache.pages_for``), makes room by evicting READY checkpoints, and commits or reports why not.

Outcomes: ADMITTED (out of the queue, into the step), SKIP (waits in place without blocking the jobs behind:
no slot, page or sequence room now, its checkpoint prefix is PENDING, or ``max_partial_prefills`` prompts are
already chunked), STOP (the step's budget is spent), LONG (set aside for the second pass).

Two passes, so that long prompts never hold up short ones queued behind them (head-of-line blocking: each long
prompt's first chunk used to take the admission budget in arrival order, so a short request waited until every
long prompt ahead of it had started). ``Admission.admit_waiting``, in arrival order, admits what fits the step whole and
sets aside (LONG) every job whose admission would start a chunked prefill, and every score prefix in production;
then the scheduler continues the running chunks; ``admit_long`` gives what is left to the set-aside jobs, oldest
first: score prefixes in production continue, and new chunked prefills start while fewer than
``max_partial_prefills`` are in progress. Aging: while fewer are, MIN_CHUNK is held for the oldest set-aside
prompt — out of the running chunks' share where they can spare it, else out of the admission budget before the
jobs behind it take it — so a stream of short requests cannot starve it (once started, the chunked prompts share at
least half of every step until they are done).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol
from weakref import WeakKeyDictionary

from gdnserve.engine.cache.checkpoint_index import (
    boundary_prefix,
    checkpoint_key,
    score_prefix,
)
from gdnserve.engine.cache.kv_cache import RESTORING, KVCache
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import CheckpointInfo
from gdnserve.engine.scheduling.engine_stats import EngineStats
from gdnserve.engine.scheduling.intake import fork_pages
from gdnserve.engine.scheduling.request import Job, Producer, Request, Sample, ScoreJob
from gdnserve.engine.scheduling.step_batch import ScoreWave, StepBatch

ADMITTED, SKIP, STOP, LONG = "admitted", "skip", "stop", "long"
NO_CACHE = "prompt_logprobs"   # miss_reason of a request that asked for prompt logprobs: it used no cached state
MIN_CHUNK = 32   # smallest prefill chunk of a long prompt, so a busy step still makes progress on it


@dataclass(eq=False)
class AdmitPass:
    """One step's admission accounting: the budget left, pages promised (running requests' next step and this
    step's admissions), whether the step already has prefill work, the live samples of the running requests
    (``Scheduler.live_seqs`` at the start, counted up as requests are admitted: nothing finishes during a pass),
    and this step's same-step producers; then the two passes' fields."""
    budget: int
    reserved: int
    busy: bool
    live: int = 0
    producers: dict[tuple[int, ...], int] = field(default_factory=dict)
    reserve: int = 0            # budget kept for the running chunks (they also get what the first pass leaves)
    partial: int = 0            # chunked prefills in progress (before the second pass: still chunked after this step)
    held: int = 0               # budget held for the oldest long prompt until the second pass
    longs: bool = False         # the second pass: chunked starts allowed
    ready: frozenset[bytes] | None = None       # READY checkpoint keys when first needed (a pass only evicts)

    def hold(self) -> None:
        """Aging: MIN_CHUNK for the oldest long prompt, first from what the running chunks' share has beyond
        MIN_CHUNK each."""
        chunks = min(MIN_CHUNK, max(self.reserve - MIN_CHUNK * self.partial, 0))
        rest = min(MIN_CHUNK - chunks, max(self.budget, 0))
        self.reserve -= chunks
        self.budget -= rest
        self.held = chunks + rest

    def over(self, batch: StepBatch, cost: int) -> bool:
        """The first prefill of an otherwise idle step may exceed the budget (a long prompt must start)."""
        return bool(batch.items or self.busy) and cost > self.budget


def _in_production(job: Job) -> bool:
    return isinstance(job, ScoreJob) and job.prod is not None


@dataclass(eq=False)
class _Plan:
    split: int | None
    key: tuple[int, ...] | None
    hit: object = None
    miss: str | None = None
    new_producer: bool = False
    cost: int = 0
    need: int = 0
    pages: int = 0
    chunk: int | None = None
    prod_chunk: int | None = None
    hkey: bytes | None = None        # checkpoint_key(key) when computed from the request's intake bytes
    publish: bool = False            # a new producer publishes the prefix as a checkpoint (else: a fork temporary)
    looks: list = field(default_factory=list)   # the lookups it made, counted in the stats when it is admitted


def _unshared(ids: list[int], n: int) -> _Plan:
    """No checkpoint: one plain prefill, or n > 1 samples forked from the prompt minus its last token."""
    split = len(ids) - 1 if n > 1 and len(ids) > 1 else None
    return _Plan(split, boundary_prefix(ids, split))


class Queues(Protocol):
    """What admission reads and moves of its scheduler (``Scheduler`` is one): typed by shape, so that
    admission.py does not import scheduler.py, which builds it."""
    cfg: EngineConfig
    kv: KVCache
    stats: EngineStats
    waiting: list[Job]
    running: list[Request]
    producing: dict[tuple[int, ...], Job]
    inflight: dict[Sample, int]

    def runnable(self, job: Job) -> bool: ...


class Admission:
    """The scheduler's admission of waiting jobs (one per scheduler): the passes and one method per case. It
    reads and moves the scheduler's queues and writes the scheduler's stats; the step's accounting is the
    ``AdmitPass`` it is handed."""

    def __init__(self, sched: Queues) -> None:
        self.sched, self.cfg, self.kv, self.stats = sched, sched.cfg, sched.kv, sched.stats
        self.long_memo: WeakKeyDictionary = WeakKeyDictionary()   # _known_long: request -> (keys seen, cost)

    # the scheduler's queues, read and moved in place
    waiting = property(lambda self: self.sched.waiting)
    running = property(lambda self: self.sched.running)
    producing = property(lambda self: self.sched.producing)

    def runnable(self, job: Job) -> bool:
        """Allowed now, and (the overlapped loop) not a request back in the queue whose last id is still on the
        device: it is recomputed from its tokens, so it waits until that id has landed."""
        return self.sched.runnable(job) and not (
            self.sched.inflight and isinstance(job, Request) and any(s in self.sched.inflight for s in job.samples))

    def admit_waiting(self, batch: StepBatch, p: AdmitPass) -> list[Job]:
        """The first pass, in arrival order: jobs that fit the step whole. Returns the jobs set aside for
        ``admit_long`` (chunked starts and score prefixes in production), oldest first."""
        pos, longs = 0, []
        while pos < len(self.waiting):
            job = self.waiting[pos]
            if not self.runnable(job):
                pos += 1
                continue
            if _in_production(job):
                r = LONG
            elif isinstance(job, ScoreJob):
                r = self.admit_score(job, batch, p)
            elif job.preempted:
                r = self.readmit(job, batch, p)
                if r == SKIP:
                    r = STOP          # a preempted request goes first: nothing overtakes it
            else:
                r = self.admit_fresh(job, batch, p)
            if r == LONG:
                if not p.held and not _in_production(job) and p.partial < self.cfg.max_partial_prefills:
                    p.hold()
                longs.append(job)
            if r == STOP:
                break
            if r != ADMITTED:
                pos += 1
        return longs

    def admit_long(self, batch: StepBatch, p: AdmitPass, longs: list[Job]) -> None:
        """The second pass, after the running chunks took their share: score prefixes in production continue, then
        the set-aside jobs start in arrival order (chunked while fewer than ``max_partial_prefills`` are)."""
        p.longs = True
        for job in longs:
            if _in_production(job):
                self.admit_score(job, batch, p)
        p.budget += p.held
        p.held = 0
        for job in longs:
            if _in_production(job):
                continue
            r = self.admit_score(job, batch, p) if isinstance(job, ScoreJob) else self.admit_fresh(job, batch, p)
            if r == STOP:
                break

    # ---------------------------------------------------------------------------- fresh requests
    def _plan(self, req: Request, p: AdmitPass) -> _Plan | None:
        """Where the request's state starts (a READY checkpoint, a same-step producer, its own producer, zeros)
        and what it costs. None: its checkpoint prefix is PENDING under a chunked producer (wait for READY).
        A request that wants prompt logprobs starts from no cached state (a checkpoint keeps no logits; vLLM skips
        its prefix cache for these too): no automatic hit, and a marker whose checkpoint is READY or PENDING is
        ignored (the whole prompt computed, nothing published); a marker whose checkpoint is absent publishes it."""
        ck, n, ids, c = self.kv.checkpoint_cache, len(req.samples), req.prompt_ids, req.checkpoint_at
        fresh = req.params.prompt_logprobs is not None
        auto, alook = ck.search(ids) if c is None and self.cfg.auto_checkpoints and not fresh else (None, None)
        if auto == RESTORING:                # its longest prefix comes up from a lower tier: wait for READY
            return None
        if auto is not None and n > 1 and fork_pages(self.cfg, len(ids), req.params.max_tokens, n, auto.length) > \
                self.cfg.pages:             # intake counted a fork at the prompt minus its last token, not this one
            auto = None
        if auto is not None and n > 1 and n * (len(ids) - auto.length) > self.cfg.max_step_tokens:
            auto = None                     # n tails from the hit would be one step beyond the budget: the fork
                                            # point is produced in chunks instead (below), the prefix recomputed
        if auto is None and alook is not None and alook.hit:
            alook = None                    # a hit not taken is not counted (the producer's own lookup is)
        if auto is None and c is None and n > 1 and not fresh and len(ids) > 1 and \
                len(ids) - 1 + n > self.cfg.max_step_tokens:
            # n samples fork from the prompt minus its last token; a fork longer than any step cannot run as the
            # one-step temporary (it would exceed the activation plan's largest step): it is produced chunk by
            # chunk as a published checkpoint there, the samples' last tokens run from it once READY
            c = len(ids) - 1
        if auto is not None:                 # an earlier request's state covers a prefix of this prompt
            pl = _Plan(auto.length, tuple(ids[:auto.length]), hit=auto)
        else:
            pl = _unshared(ids, n) if c is None else _Plan(c, boundary_prefix(ids, c), publish=True)
            if c is None and fresh and self.cfg.auto_checkpoints:
                pl.miss = NO_CACHE
        if c is None and alook is not None:  # the automatic search's one lookup (a fork point counts its own)
            pl.looks.append(alook)
        if c is not None and pl.key not in p.producers:
            pending = pl.key in self.producing          # under a chunked producer
            if pending and not fresh:
                return None
            pl.hkey = req.prefix_key(pl.split)
            look = None if pending else ck.lookup(pl.key, pl.hkey, count=False)
            if look is not None:
                pl.looks.append(look)
            if look is not None and ck.is_restoring(look.entry):    # coming up from a lower tier
                if not fresh:
                    return None
                pending = True
            if fresh and (pending or look.hit):
                pl = _unshared(ids, n)
                pl.miss = NO_CACHE
            else:
                pl.hit = look.entry if look.hit else None
                pl.miss = None if look.hit else look.reason.value
        pl.new_producer = pl.key is not None and pl.key not in p.producers and pl.hit is None
        tail = len(ids) if pl.split is None else len(ids) - pl.split
        pl.cost = tail * n + (pl.split if pl.new_producer else 0)
        pl.need = n + (1 if pl.new_producer else 0)
        if pl.split is None:
            pl.pages = n * self.kv.pages_for(len(ids))
        else:
            pl.pages = n * self.kv.pages_for(tail, shared=pl.split) + (self.kv.pages_for(pl.split) if pl.new_producer else 0)
        return pl

    def _chunking(self, req: Request, pl: _Plan, p: AdmitPass) -> None:
        """A long plain prompt prefills its first chunk now; a checkpoint producer too long for any step (or a step
        busy with chunks) runs its prefix chunk by chunk into the PENDING checkpoint (one that fits a step waits for
        one instead, to run with its same-pass consumers)."""
        n = len(req.samples)
        if pl.cost <= max(p.budget, MIN_CHUNK) or (req.params.prompt_logprobs is not None
                                                   and not (pl.key is None and n == 1)):
            return
        if pl.key is None and n == 1:
            pl.chunk = pl.cost = max(p.budget, MIN_CHUNK)
            pl.pages = self.kv.pages_for(pl.chunk)
        elif pl.hit is not None and n == 1:   # a READY hit's long tail: its first chunk from the checkpoint now,
            pl.chunk = pl.cost = max(p.budget, MIN_CHUNK)    # the rest on the sample's own slot (a chat turn that
            pl.pages = self.kv.pages_for(pl.chunk, shared=pl.split)   # pastes a document after an earlier turn)
        elif pl.new_producer and pl.publish and (p.busy or pl.cost > self.cfg.max_step_tokens):
            pl.prod_chunk = pl.cost = min(pl.split, max(p.budget, MIN_CHUNK))
            pl.pages = self.kv.pages_for(pl.split)      # admitted only when the whole prefix fits: not preempted for it

    def _known_long(self, req: Request, p: AdmitPass) -> bool:
        """A plain prompt planned as too long for the step before, and no READY checkpoint since is a prefix of it:
        long again without a plan. A plan looks a prefix up per READY checkpoint length (~150 us each at 4k tokens),
        and the first pass meets every waiting long prompt in every step; this hashes one prefix per checkpoint
        added since. The memo: the keys known not to be its prefix, and its cost."""
        memo = self.long_memo.get(req)
        if memo is None or memo[1] <= max(p.budget, MIN_CHUNK):
            return False
        pages = self.kv.checkpoint_cache.pages
        if p.ready is None:
            p.ready = frozenset(pages)
        new = [k for k in p.ready - memo[0] if k in pages]
        for k in new:
            n = pages[k].length
            if n < len(req.prompt_ids) and (req.prefix_key(n) or checkpoint_key(req.prompt_ids[:n])) == k:
                return False
        if new:
            self.long_memo[req] = (memo[0] | frozenset(new), memo[1])
        return True

    def admit_fresh(self, req: Request, batch: StepBatch, p: AdmitPass) -> str:
        limit = self.cfg.max_partial_prefills
        if (not p.longs or p.partial >= limit) and self._known_long(req, p):
            return SKIP if p.longs else LONG
        if p.live + len(req.samples) > self.cfg.max_num_seqs:
            # no seat for it this step: skip before planning, whose lookups would restore its checkpoint from a
            # lower tier only for the next waiter's restore to evict it again (restores thrashed, review finding)
            return SKIP
        pl = self._plan(req, p)
        if pl is None:
            return SKIP
        cost = pl.cost
        self._chunking(req, pl, p)
        if pl.chunk is not None:
            self.long_memo[req] = (frozenset(self.kv.checkpoint_cache.pages), cost)
        if pl.chunk is not None or pl.prod_chunk is not None:     # a long prompt (no hit to release)
            if not p.longs:
                return LONG
            if p.partial >= limit:
                return SKIP
        if pl.hit is not None:
            self.kv.checkpoint_cache.acquire(pl.hit)          # pinned now, so the evictions below cannot take it
        self.kv.make_room(pl.need, pl.pages, p.reserved)
        why = None
        if not self.kv.fits(pl.need, pl.pages, p.reserved):     # (seats: checked before planning, above)
            why = SKIP
        elif p.over(batch, pl.cost):
            why = STOP
        if why is None:
            if pl.hit is not None:
                batch.acquired.append(pl.hit)
            self._commit_fresh(req, pl, batch, p)
            return ADMITTED
        if pl.hit is not None:
            self.kv.checkpoint_cache.release(pl.hit)
            if not self.running and not batch.items and pl.hit.refcount == 0:
                # nothing runs that could free room and the checkpoint itself takes it: drop it (with every
                # unreferenced checkpoint) and take the request again as a miss, never wait forever
                self.kv.checkpoint_cache.evict(len(self.kv.checkpoint_cache))
                return self.admit_fresh(req, batch, p)
        return why

    def _producer_item(self, req: Request, pl: _Plan, batch: StepBatch, p: AdmitPass) -> None:
        if pl.publish:                        # publish the prefix as a checkpoint: PENDING now, READY after the step
            entry, prod = self.kv.checkpoint_cache.reserve(pl.key, self.kv.pages, pl.hkey)
            req.checkpoint = CheckpointInfo(hit_length=0, miss_reason=pl.miss, published=True)
            self.stats.published(pl.miss)
            if pl.prod_chunk is not None:     # READY after its last chunk's step
                req.prod = Producer(entry, prod)
                self.producing[pl.key] = req
                batch.prod_chunks.append((req, pl.prod_chunk == pl.split))
            else:
                batch.pending.append((entry, prod))
        else:                                  # the fork of n samples: a temporary, freed after the step
            prod = self.kv.new_seq()
            batch.temps.append(prod)
        idx = batch.add(PrefillItem(prod, list(pl.key[:pl.prod_chunk]), all_logits=req.params.prompt_logprobs is not None))
        if pl.prod_chunk is None:
            p.producers[pl.key] = idx

    def _commit_fresh(self, req: Request, pl: _Plan, batch: StepBatch, p: AdmitPass) -> None:
        for look in pl.looks:                 # counted once, now: a waiting request is planned again every step
            self.kv.checkpoint_cache.index.count(look)
        self.waiting.remove(req)
        self.running.append(req)                 # first, so a failure below still finds what it holds
        batch.join(req, admitted=True)
        ids, want_all = req.prompt_ids, req.params.prompt_logprobs is not None
        ckpt = None
        if pl.miss == NO_CACHE:
            req.checkpoint = CheckpointInfo(miss_reason=NO_CACHE)
        if pl.new_producer:
            self._producer_item(req, pl, batch, p)
        elif pl.hit is not None:              # acquired; released after the step
            ckpt = self.kv.checkpoint_cache.kv_of(pl.hit)
            req.checkpoint = CheckpointInfo(hit_length=pl.split, tier=self.kv.checkpoint_cache.hit_tier(
                pl.hit, continued=req.checkpoint_at is None))
            self.stats.checkpoint_hits += 1
        elif pl.key is not None:
            req.checkpoint = CheckpointInfo(hit_length=pl.split)
            self.stats.checkpoint_hits += req.checkpoint_at is not None
        start = pl.split if pl.hit is not None else 0      # a chunked hit's tail starts at the checkpoint
        req.num_computed = start + pl.chunk if pl.chunk is not None else pl.prod_chunk if pl.prod_chunk is not None \
            else len(ids)
        for smp in req.samples:
            smp.seq = self.kv.new_seq()
            if pl.chunk is not None:           # nothing is sampled until the last chunk
                idx = batch.add(PrefillItem(smp.seq, list(ids[start:start + pl.chunk]), start_from=ckpt,
                                            all_logits=want_all))
                if want_all:                   # its prompt logprobs come chunk by chunk (a fresh prompt: start 0)
                    batch.prompt_chunks.append((idx, req, start, False))
            elif pl.prod_chunk is not None:
                continue                       # the slot waits for the READY prefix
            elif pl.key is None:
                batch.add(PrefillItem(smp.seq, list(ids), all_logits=want_all), (req, smp))
            elif ckpt is not None:
                batch.add(PrefillItem(smp.seq, list(ids[pl.split:]), start_from=ckpt, all_logits=want_all), (req, smp))
            else:
                prod = p.producers[pl.key]
                batch.items[prod].all_logits |= want_all
                batch.add(PrefillItem(smp.seq, list(ids[pl.split:]), producer=prod, all_logits=want_all), (req, smp))
        p.budget -= pl.cost
        p.reserved += pl.pages
        p.live += len(req.samples)
        p.partial += pl.chunk is not None or pl.prod_chunk is not None
        self.stats.prompt_tokens += len(ids)

    # ---------------------------------------------------------------------------- readmission
    def readmit(self, req: Request, batch: StepBatch, p: AdmitPass) -> str:
        """Recompute a preempted request: every unfinished sample's state after prompt + its output minus the last
        token (the next step decodes that token). Several unfinished samples fork as on first admission: a producer
        prefills the prompt minus its last token once (a temporary) and each sample continues it with the last
        prompt token + its own output; a single one is one plain prefill. Finished samples keep their outputs;
        seeded samples continue their random streams unchanged."""
        live = req.live_samples
        prompt = req.prompt_ids
        fork = len(live) > 1 and len(prompt) > 1
        head = prompt[:-1] if fork else []
        tails = [(prompt[-1:] if fork else prompt) + smp.token_ids[:-1] for smp in live]
        cost = len(head) + sum(map(len, tails))
        need = len(live) + fork
        pages = (self.kv.pages_for(len(head)) if fork else 0) + sum(self.kv.pages_for(len(t), shared=len(head)) for t in tails)
        self.kv.make_room(need, pages, p.reserved)
        if not self.kv.fits(need, pages, p.reserved) or p.live + len(live) > self.cfg.max_num_seqs:
            return SKIP
        if p.over(batch, cost):
            return STOP
        self.waiting.remove(req)
        self.running.append(req)
        batch.join(req, admitted=True)
        producer = -1
        if fork:
            prod = self.kv.new_seq()
            batch.temps.append(prod)
            producer = batch.add(PrefillItem(prod, head))
        for smp, toks in zip(live, tails):
            smp.seq = self.kv.new_seq()
            batch.add(PrefillItem(smp.seq, toks, producer=producer))    # nothing sampled: the next step decodes
        p.budget -= cost
        p.reserved += pages
        p.live += len(live)
        req.num_computed = len(prompt)
        return ADMITTED

    # ---------------------------------------------------------------------------- score waves
    def _score_source(self, job: ScoreJob, batch: StepBatch, p: AdmitPass):
        """Where this wave's candidates start: ("ready", kv) from the prefix checkpoint (held by the job or hit now),
        ("producer", item) of this step, ("zeros", None) for a one-token prefix; None: wait (PENDING elsewhere, or
        the prefix is still being produced chunk by chunk — its next chunk is added here); STOP: the budget is spent."""
        key = score_prefix(job.prefix_ids)
        ck = self.kv.checkpoint_cache
        if not key:
            return "zeros", None
        if job.prod is not None:                      # chunked prefix in production: its next chunk
            rem = len(key) - job.num_computed
            n = min(rem, max(p.budget, MIN_CHUNK))
            need = job.prod.pages.pages_needed(n)
            self.kv.make_room(0, need, p.reserved)
            if not self.kv.fits(0, need, p.reserved):
                return None
            p.reserved += need
            batch.join(job)
            batch.add(PrefillItem(job.prod, list(key[job.num_computed:job.num_computed + n])))
            batch.prod_chunks.append((job, n == rem))
            job.num_computed += n
            p.budget -= n
            return None
        if job.entry is not None:
            return "ready", ck.kv_of(job.entry)
        hit = CheckpointInfo(hit_length=len(job.prefix_ids))
        if key in p.producers:
            job.checkpoint = job.checkpoint or hit
            return "producer", p.producers[key]
        if key in self.producing:
            return None
        look = ck.lookup(key)
        if look.hit:
            ck.acquire(look.entry)
            batch.acquired.append(look.entry)
            job.checkpoint = job.checkpoint or replace(hit, tier=ck.hit_tier(look.entry))   # a later wave of a
            # job that published it keeps saying so
            return "ready", ck.kv_of(look.entry)
        if look.entry is not None:                    # PENDING under another producer
            return None
        first = len(key) + min(len(job.candidates[i]) + 1 for i in job.todo)
        # a prefix that fits a step waits for one (as a checkpoint producer does) to run with its candidates;
        # one too long for any step (or a step busy with chunks) is produced chunk by chunk
        chunked = first > max(p.budget, MIN_CHUNK) and (p.busy or first > self.cfg.max_step_tokens)
        if chunked and not p.longs:
            return LONG
        if chunked and p.partial >= self.cfg.max_partial_prefills:
            return None
        if not chunked and p.over(batch, first):
            return STOP
        self.kv.make_room(1, self.kv.pages_for(len(key)), p.reserved)
        if not self.kv.fits(1, self.kv.pages_for(len(key)), p.reserved):
            return None
        entry, prod = ck.reserve(key, self.kv.pages)
        p.reserved += self.kv.pages_for(len(key))
        miss = look.reason.value                      # counted as a marker's producer counts its publication
        job.checkpoint = CheckpointInfo(miss_reason=miss, published=True)
        self.stats.published(miss)
        if chunked:
            job.entry, job.prod = entry, prod         # a long prefix: chunk by chunk into the PENDING checkpoint
            self.producing[key] = job
            p.partial += 1
            return self._score_source(job, batch, p)
        batch.pending.append((entry, prod))
        idx = batch.add(PrefillItem(prod, list(key)))
        p.producers[key] = idx
        p.budget -= len(key)
        batch.join(job)
        return "producer", idx

    def admit_score(self, job: ScoreJob, batch: StepBatch, p: AdmitPass) -> str:
        """As many of the job's candidates as fit this step (slots, pages, budget), each a consumer of the prefix
        minus its last token fed ``[last prefix token] + candidate`` with every row's logits."""
        src = self._score_source(job, batch, p)
        if src is None or src in (STOP, LONG):
            return SKIP if src is None else src
        kind, ref = src
        shared = len(job.prefix_ids) - 1
        wave = ScoreWave(job)
        batch.join(job, admitted=True)
        for i in list(job.todo):
            toks = job.prefix_ids[-1:] + job.candidates[i]
            pages = self.kv.pages_for(len(toks), shared=shared)
            self.kv.make_room(1, pages, p.reserved)
            if not self.kv.fits(1, pages, p.reserved) or p.over(batch, len(toks)):
                break
            seq = self.kv.new_seq()
            batch.temps.append(seq)
            item = PrefillItem(seq, toks, all_logits=True, producer=ref if kind == "producer" else -1,
                               start_from=ref if kind == "ready" else None)
            wave.items.append(batch.add(item))
            wave.cands.append(i)
            job.todo.remove(i)
            p.budget -= len(toks)
            p.reserved += pages
        if wave.cands:
            batch.waves.append(wave)
            self.stats.prompt_tokens += sum(len(job.candidates[i]) for i in wave.cands)
            info = job.checkpoint or CheckpointInfo()
            if info.published or info.hit_length:     # (a one-token prefix starts from zeros: no checkpoint)
                publisher = info.published and job.publisher in (None, *wave.cands)   # reports the publication
                self.stats.checkpoint_hits += len(wave.cands) - publisher
        if not job.todo:
            self.waiting.remove(job)
            return ADMITTED
        return STOP if p.budget <= 0 else SKIP
