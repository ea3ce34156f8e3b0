"""The engine loop: continuous batching of prefills, decodes, verifies and score waves over the ModelRunner.

``step()`` reads top-down: the scheduler returns the step's batch (``scheduler.py``, ``admission.py``), the runner
runs it, the output processor turns logits into tokens, stop decisions, text, logprobs and scores
(``output_processor.py``), and the scheduler applies the result (``Scheduler.update_from_output``: checkpoints
READY, finished samples published as automatic checkpoints or freed, a failed step rolled back, the counters).

Checkpoints: a request that names a boundary (a marker or ``checkpoint_at``) is split there into a producer and
consumers in the same step; later requests with the same prefix start from the READY checkpoint, which stays
in the cache (``kv_cache.py``) until LRU eviction under slot or page pressure. Automatic checkpoints (on by
default) serve the next turn of a chat. ``n > 1`` samples fork from the prompt minus its last token. Long
prompts and long checkpoint prefixes are prefilled chunk by chunk. Under page pressure READY checkpoints are
evicted and then the newest requests preempted and later recomputed. Speculative decoding (``spec_k > 0``):
single-sample requests verify k drafts per step (docs/spec_decode.md).

Failure domain: a step that raises is rolled back and its culprit isolated (``isolation.py``); only that request
fails, with the error as its reason, and every other one gives the output it gives alone. The first failed step
re-raises its error after the rollback (the engine stays consistent); the trials run in the following steps.
An ``EngineDeadError`` (a tensor-parallel worker gone) is no request's fault: every request fails with it, and so
does every later submission (``dead``).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gdnserve.engine.cache.checkpoint_tiers import build_tiers
from gdnserve.engine.cache.kv_cache import KVCache
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import EngineDeadError, RequestOutput, ScoreResult
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
    build_pools,
)
from gdnserve.engine.execution.sampler import Sampler
from gdnserve.engine.execution.step_inputs import DecodeFeed
from gdnserve.engine.memory.memory_budget import resolve_pools, weights_bytes
from gdnserve.engine.output_processor import OutputProcessor
from gdnserve.engine.scheduling.engine_stats import EngineStats, StepReport
from gdnserve.engine.scheduling.intake import make_request, make_score_job
from gdnserve.engine.scheduling.isolation import Isolation
from gdnserve.engine.scheduling.request import (
    Job,
    Request,
    RequestError,
    Sample,
    ScoreJob,
)
from gdnserve.engine.scheduling.scheduler import MIN_CHUNK, Scheduler
from gdnserve.engine.scheduling.step_batch import Processed, StepBatch, StepOutput
from gdnserve.speculative.ngram import NgramDrafter

__all__ = ["LLMEngine", "RequestError", "MIN_CHUNK"]


@dataclass(eq=False)
class _InFlight:
    """The overlapped loop's launched step: its batch, its output (ids on the device, the copy under way) and
    each sampled sample's row of those ids."""
    batch: StepBatch
    out: StepOutput
    rows: dict[Sample, int]


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, runner: RunnerConfig | None = None,
                 runner_factory=ModelRunner, **kw):
        """``config`` (or, for callers that size the pools themselves, ``runner`` plus EngineConfig fields as
        keywords: max_num_seqs, max_step_tokens, max_model_len, model_name, seed, auto_checkpoints, spec_k,
        spec_mode, spec_draft, cuda_graphs). ``runner_factory(model, rc, pools=...)``: the runner class
        (tensor parallel: tp_runner.TPRunner bound to its worker group)."""
        if config is None:
            config = EngineConfig.from_runner(runner, **kw) if runner is not None else EngineConfig(**kw)
        elif kw or runner is not None:
            raise TypeError("pass either config or runner / keyword fields, not both")
        w = model.embed_tokens.weight
        weights = weights_bytes(model)
        # the pools sized (or given sizes checked) before they are allocated: a clean error, not an OOM
        cfg, self.memory_plan = resolve_pools(config, model.cfg, w.dtype, w.device, weights=weights, resident=weights,
                                              model=model)
        self.config = cfg
        rc = cfg.runner_config()
        state, pages = build_pools(model, rc)
        self.runner = runner_factory(model, rc, pools=(state, pages))
        try:        # after the runner: the per-slot rows it registers with the state pool travel with a checkpoint
            tiers = build_tiers(cfg, model, state, pages)
        except BaseException:
            self.runner.close()     # the model's layers unbound from the pools, as if the runner was never built
            raise
        self.kv = KVCache(state, pages, tiers)
        self.dead: str | None = None        # set by a fatal error (EngineDeadError): every request fails with it
        self.tokenizer = tokenizer
        self.model_name, self.max_model_len, self.spec_k = cfg.model_name, cfg.max_model_len, cfg.spec_k
        self.vocab_size = model.cfg.vocab_size
        # n-gram drafts are proposed by the scheduler on the host; MTP drafts inside the runner's step, on the device
        drafter = NgramDrafter(cfg.spec_k) if cfg.spec_k and cfg.spec_draft == "ngram" else None
        self.scheduler = Scheduler(cfg, self.kv, drafter)
        self.sampler = Sampler(cfg.seed)
        self.outputs = OutputProcessor(tokenizer, self.sampler, cfg.max_model_len, cfg.spec_k)
        self.isolation = Isolation()
        self.requests: dict[str, Job] = {}
        self.scores: dict[str, ScoreResult | BaseException] = {}    # finished score jobs, until taken
        self._backlog: list[RequestOutput] = []                      # outputs produced while score() stepped
        self._ids = itertools.count()
        self._observer: Callable[[StepReport], None] | None = None
        self.overlap = cfg.overlapped(w.device.type)       # the overlapped loop (step())
        self._inflight: _InFlight | None = None             # its step on the device, results not read back

    # ------------------------------------------------------------------ views kept for callers and tests
    drafter = property(lambda self: self.scheduler.drafter,
                       lambda self, d: setattr(self.scheduler, "drafter", d))
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    index = property(lambda self: self.kv.checkpoint_cache.index)
    ckpt_pages = property(lambda self: self.kv.checkpoint_cache.pages)
    max_num_seqs = property(lambda self: self.config.max_num_seqs)
    max_step_tokens = property(lambda self: self.config.max_step_tokens)
    auto_checkpoints = property(lambda self: self.config.auto_checkpoints)

    @property
    def tier_stats(self):
        """The checkpoint tiers' TierStats (None without tiers), read by /metrics."""
        t = self.kv.checkpoint_cache.tiers
        return None if t is None else t.stats

    @property
    def counts(self) -> EngineStats:
        """The engine's counters (the scheduler writes them; read them, do not write)."""
        return self.scheduler.stats

    def checkpoint_keys(self) -> tuple[list[bytes], list[bytes], list[int]]:
        """READY keys, PENDING keys and READY lengths of the checkpoints (what a replica's router reads): the index's
        and, as READY, those of the host and disk tiers (a lookup restores them)."""
        return self.kv.checkpoint_cache.keys()

    def set_step_observer(self, observer: Callable[[StepReport], None] | None) -> None:
        """Call ``observer`` after every ``step()`` (on the thread that steps) with its StepReport; one observer, a
        later call replaces it (None: none)."""
        self._observer = observer

    def evict_checkpoints(self, n: int) -> bool:
        """Evict up to n unreferenced READY checkpoints (LRU), freeing their slots and pages."""
        return self.kv.checkpoint_cache.evict(n)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, request_id: str | None, prompt, params, checkpoint_at: int | None = None) -> Request:
        """Validate and tokenize (no engine state is read: safe on any thread); raises RequestError."""
        return make_request(self.config, self.tokenizer, self.vocab_size, request_id or self.new_request_id(),
                            prompt, params, checkpoint_at)

    def make_score(self, request_id: str | None, prefix, candidates, label_token_ids=None) -> ScoreJob:
        return make_score_job(self.config, self.tokenizer, self.vocab_size,
                              request_id or f"score-{next(self._ids)}", prefix, candidates, label_token_ids)

    def submit(self, job: Job) -> str:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if job.request_id in self.requests:
            raise RequestError(f"request_id {job.request_id!r} is already in use")
        self.requests[job.request_id] = job
        self.scheduler.add(job)
        return job.request_id

    def add_request(self, request_id: str | None, prompt: str | list[int], params, checkpoint_at: int | None = None
                    ) -> str:
        return self.submit(self.make_request(request_id, prompt, params, checkpoint_at))

    def add_score(self, prefix, candidates, label_token_ids=None, request_id: str | None = None) -> str:
        """Queue a score job; step until ``take_score(id)`` returns its result."""
        return self.submit(self.make_score(request_id, prefix, candidates, label_token_ids))

    def take_score(self, request_id: str) -> ScoreResult | BaseException | None:
        return self.scores.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        job = self.requests.get(request_id)
        if job is None:
            return
        job.fail(None if isinstance(job, Request) else "aborted")
        self._retire(job)
        self.scores.pop(request_id, None)     # whoever aborts a score job does not take its result

    def warm_up(self) -> str:
        """Before serving: capture every decode / verify CUDA graph (compiling their kernels) so that the first
        requests do not (``ModelRunner.warm_up``); a line for the banner ("" when there is nothing to warm: no
        graphs)."""
        return self.runner.warm_up()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._backlog) or self._inflight is not None

    def stats(self) -> dict:
        st, pg = self.kv.state, self.kv.pages
        return {"queue_depth": len(self.waiting), "running": len(self.running),
                "state_pool_used": st.num_slots - st.num_free, "state_pool_total": st.num_slots,
                "page_pool_used": pg.num_pages - pg.num_free, "page_pool_total": pg.num_pages,
                "checkpoints_ready": len(self.ckpt_pages), **self.counts.as_dict()}

    def score(self, prefix, candidates, label_token_ids=None) -> ScoreResult:
        """Score now: the job is scheduled with everything else, in waves that fit the step (other requests'
        outputs produced meanwhile come out of the next ``step()``)."""
        rid = self.add_score(prefix, candidates, label_token_ids)
        failures = 0
        while True:
            res = self.take_score(rid)
            if res is not None:
                if isinstance(res, BaseException):
                    raise res
                return res
            try:
                self._backlog += self._step()
                failures = 0
            except Exception:       # noqa: BLE001  rolled back; the isolation trials follow
                failures += 1
                if failures > 3:    # not a request's fault: every step fails
                    self.abort(rid)
                    raise

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run (forward, batched sampling) -> process per request -> the scheduler's update
        -> outputs (after those produced while ``score()`` stepped). Overlapped (``overlap``): this step is
        launched with the previous step's sampled ids still on the device, and the previous step's outputs are
        processed while it runs; its own come out of the next call."""
        t0 = time.monotonic()
        outs, self._backlog = self._backlog, []
        batch = None
        try:
            batch = self._schedule()
            return outs + self._run(batch)
        finally:
            if self._observer is not None:
                self._observer(StepReport(t0, time.monotonic() - t0, self._admitted(batch)))

    def _step(self) -> list[RequestOutput]:
        return self._run(self._schedule())

    def _schedule(self) -> StepBatch:
        fly = self._inflight
        return self.scheduler.schedule(self.isolation.allowed(), fly.rows if fly is not None else None)

    def _run(self, batch: StepBatch) -> list[RequestOutput]:
        """Serial: launch the step and land it. Overlapped: launch it, land the step in flight while it runs, and
        keep it in flight (unless its results must be read back at once). A failed step lands after the one in
        flight, so a rollback never drops an output that step produced."""
        prev, self._inflight = self._inflight, None
        if batch.empty and batch.error is None:
            return self._land(prev, None) if prev is not None else self._idle()
        out = self._launch(batch, prev)
        try:
            outs = self._land(prev, batch if out.ran else None) if prev is not None else []
        except Exception:
            # the step in flight failed (rolled back, its isolation started): the step just launched behind it read
            # its ids, so it is rolled back too (its jobs requeued, its checkpoints dropped, references released)
            out.ran, out.error = False, out.error or RuntimeError("the step before it failed")
            self.scheduler.update_from_output(batch, out)
            raise
        if out.error is not None and prev is not None:     # isolation marks progress past the landed step
            batch.marks = {job: job.progress() for job in batch.jobs}
        if out.error is None and self._deferrable(batch):
            self.scheduler.settle(batch)            # before the next schedule: device work is stream-ordered
            self._inflight = _InFlight(batch, out, {s: i for i, (_, s) in enumerate(out.sampling.owners)})
            return outs
        try:
            return outs + self._land(_InFlight(batch, out, {}), None)
        except Exception:
            self._backlog = outs + self._backlog    # the previous step's outputs are not lost with the error
            raise

    def _launch(self, batch: StepBatch, prev: _InFlight | None) -> StepOutput:
        """The forward and the batched, device-side sampling; a failure there fails the step."""
        out = StepOutput(error=batch.error)
        if out.error is not None:
            return out
        try:
            feed = DecodeFeed.of(prev.out.sampling.tokens, batch.feed) if batch.feed else None
            kw = {"feed": feed} if feed is not None else {}
            out.logits = self.runner.step(batch.items, batch.decodes, verifies=batch.verifies, ready=batch.ready,
                                          **kw)
            out.ran = True
            out.sampling, out.accepted = self._sample(batch, out.logits, prev.rows if prev is not None else {})
        except Exception as e:       # noqa: BLE001  rolled back by the scheduler, isolated here
            out.error = e
        return out

    def _land(self, fl: _InFlight, running: StepBatch | None) -> list[RequestOutput]:
        """A launched step's results read back (the one device-to-host copy) and applied: per request on the host
        (a failure there is that request's alone), then the scheduler's update. ``running``: the step launched
        after it, still on the device: a sample it decodes is not published (its state runs one id past)."""
        batch, out = fl.batch, fl.out
        if out.error is None:
            try:
                sampled = list(zip(out.sampling.owners, out.sampling.result()))
            except Exception as e:   # noqa: BLE001
                out.error = e
        if out.error is None:
            out.processed = done = self._process(batch, out.logits, sampled, out.accepted)
            if running is not None:
                busy = {id(seq) for seq, _ in running.decodes} | {id(it.seq) for it in running.items}
                stale = [(r, s) for r, s in done.finished if id(s.seq) in busy]
                done.finished = [(r, s) for r, s in done.finished if id(s.seq) not in busy]
                for _, s in stale:    # decoded once more by the running step: one id past, never published; freed
                    self.scheduler.free_sample(s)   # now, as the serial loop does (stream order: a later owner's
                                                    # kernels run after that step's)
            self.runner.flush(done.finished_seqs())   # replay-pending tokens land before a slot is published
        self.scheduler.update_from_output(batch, out)
        if out.error is not None:
            return self._die(out.error) if out.dead else self._failed(batch, out.error)
        for req, why in out.processed.failed:
            self._fail(req, why)
        self.isolation.passed()
        return self._outputs(batch, out.processed)

    def _deferrable(self, batch: StepBatch) -> bool:
        """The overlapped loop keeps a step in flight unless its results must be read back at once: draft
        acceptance, score results and prompt logprobs read the logits on the host; a failure being isolated
        runs serially."""
        return (self.overlap and not self.isolation.active and not batch.verified and not batch.waves
                and not any(it.all_logits for it in batch.items))

    def _admitted(self, batch: StepBatch | None) -> tuple[str, ...]:
        """Request ids the step admitted that are out of the queue now (a failed step requeued its own)."""
        if batch is None or not batch.admitted:
            return ()
        waiting = set(map(id, self.scheduler.waiting))
        return tuple(j.request_id for j in batch.admitted if id(j) not in waiting)

    def _sample(self, batch: StepBatch, logits: torch.Tensor, inflight: dict):
        """The batched, device-side part of processing: sampling (read back later: ``Sampled.result``) and draft
        acceptance (with the commit). ``inflight``: samples whose previous id is still on the device (one more
        generation step than their tokens say: what a seeded row's stream reads)."""
        first, r = [], 0
        for it in batch.items:
            first.append(r)
            r += len(it.tokens) if it.all_logits else 1
        last = [f + (len(it.tokens) - 1 if it.all_logits else 0) for f, it in zip(first, batch.items)]
        rows = [last[i] for i, o in enumerate(batch.owners) if o is not None] + [r + j for j in range(len(batch.decodes))]
        owners = [o for o in batch.owners if o is not None] + batch.dec_owners
        sampled = self.outputs.sample_async(logits, rows, owners,
                                            [len(s.token_ids) + (s in inflight) for _, s in owners])
        accepted = []
        if batch.verified:
            v0 = r + len(batch.decodes)
            counts, toks, lps = self.outputs.accept(logits[v0:], batch.verified, self.runner.drafts,
                                                    lambda dev: self.sampler.generator(dev))
            self.runner.accept([(s.seq, len(t)) for (_, s), t in zip(batch.verified, toks)], counts)
            accepted = [(v, (t, lp)) for v, t, lp in zip(batch.verified, toks, lps)]
        if batch.waves:
            self.outputs.score_results(batch, first, logits)
        batch.first_rows = first
        return sampled, accepted

    def _process(self, batch: StepBatch, logits, sampled, accepted) -> Processed:
        """Per request, host side; a failure here is that request's alone."""
        out = Processed()
        per_req: dict[Request, list] = {}
        for (req, s), tok in sampled:
            if self.requests.get(req.request_id) is not req or s.finish_reason is not None:
                continue        # overlapped loop: aborted meanwhile, or an id past its stop (never emitted)
            per_req.setdefault(req, []).append(("tok", s, tok))
        for (req, s), toks in accepted:
            per_req.setdefault(req, []).append(("spec", s, toks))
        chunked = {i for i, *_ in batch.prompt_chunks}
        for i, (it, o) in enumerate(zip(batch.items, batch.owners)):
            if o is not None and it.all_logits and o[1].index == 0 and o[0].params.prompt_logprobs is not None \
                    and i not in chunked:
                per_req.setdefault(o[0], []).insert(0, ("prompt", i, None))
        for i, req, start, last in batch.prompt_chunks:
            if self.requests.get(req.request_id) is req:
                per_req.setdefault(req, []).insert(0, ("prompt_chunk", i, (start, last)))
        for req, work in per_req.items():
            if any(kind != "prompt_chunk" or b[1] for kind, _, b in work):    # (a middle chunk emits nothing)
                out.touched.append(req)
            try:
                for kind, a, b in work:
                    if kind == "prompt":
                        self.outputs.prompt_logprobs(batch, batch.first_rows, logits, a)
                    elif kind == "prompt_chunk":
                        self.outputs.prompt_logprobs_chunk(batch, batch.first_rows, logits, a, req, *b)
                    elif kind == "tok":
                        self.outputs.append(req, a, b[0], b[1], b[2], out)
                    else:
                        toks, lps = b
                        out.verified += 1
                        out.drafts_accepted += len(toks) - 1
                        for j, tok in enumerate(toks):
                            if a.finish_reason is None:     # tokens past a stop (EOS, stop string) are dropped
                                lp, d = lps[j] if lps is not None else (None, None)
                                self.outputs.append(req, a, tok, lp, d, out)
            except Exception as e:   # noqa: BLE001
                out.failed.append((req, f"{type(e).__name__}: {e}"))
        return out

    def _outputs(self, batch: StepBatch, done: Processed) -> list[RequestOutput]:
        outs = []
        for req in done.touched:
            if req.finished:
                self._retire(req)
            outs.append(self.outputs.output(req))
        for w in batch.waves:
            if w.job.finished and w.job.request_id in self.requests:
                self._retire(w.job)
        return outs

    # ------------------------------------------------------------------ failures
    def _idle(self) -> list[RequestOutput]:
        if self.isolation.active:       # the trial's jobs cannot run now: stop isolating, retry all
            self.isolation.give_up()
            return []
        return self._unfit()

    def _failed(self, batch: StepBatch, err: Exception) -> list[RequestOutput]:
        """The scheduler rolled the step back (every job requeued, recomputed later); isolate the culprit. Outside a
        trial the error is re-raised."""
        live = [j for j in batch.jobs if j.request_id in self.requests]
        if not self.isolation.active:
            self.isolation.start(live, batch.admitted, batch.marks)
            raise err
        culprit = self.isolation.failed(batch.marks)
        if culprit is None or culprit.request_id not in self.requests:
            return []
        return self._fail(culprit, f"{type(err).__name__}: {err}")

    def _die(self, err: EngineDeadError) -> list[RequestOutput]:
        """A fatal error (a tensor-parallel worker is gone): every job fails with it, and so will every later one."""
        self.dead = str(err)
        return [o for job in list(self.requests.values()) for o in self._fail(job, self.dead)]

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers); idempotent."""
        self.kv.checkpoint_cache.close()          # a disk tier keeps what the device and host hold
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _unfit(self) -> list[RequestOutput]:
        """Nothing runs and nothing waiting could be admitted even with every checkpoint evicted: those jobs
        can never run (the submission check bounds pages per token, not a producer's extra pages); fail them
        rather than wait forever."""
        if self.running or not self.waiting:
            return []
        self.kv.checkpoint_cache.evict(len(self.kv.checkpoint_cache))
        st, pg = self.kv.state, self.kv.pages
        why = (f"does not fit the engine even alone ({st.num_slots} state slots, {pg.num_pages} KV pages of "
               f"{pg.page_size}, max_num_seqs {self.config.max_num_seqs})")
        return [o for job in list(self.waiting) for o in self._fail(job, why)]

    def _fail(self, job: Job, why: str) -> list[RequestOutput]:
        job.fail(why)
        self._retire(job, failed=True)
        return [self.outputs.output(job)] if isinstance(job, Request) else []

    def _retire(self, job: Job, failed: bool = False) -> None:
        known = self.requests.pop(job.request_id, None) is not None
        self.scheduler.retire(job, failed=failed, finished=known)
        self.isolation.forget(job)
        if not known:
            return
        if isinstance(job, ScoreJob):
            self.scores[job.request_id] = (RuntimeError(f"score failed: {job.error}") if job.error else
                                           ScoreResult(job.prefix_ids, list(job.results)))
