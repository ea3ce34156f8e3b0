"""StepBatch: what ``Scheduler.schedule()`` hands the runner and the output processor for one step, as data (the
READY checkpoint slots it touches included: the plan's ownership check reads them, no callback), and what the
step holds that must be settled after it (temporaries, checkpoints published or read, producer chunks).
StepOutput: what became of the step, for ``Scheduler.update_from_output`` (with the output processor's
``Sampled`` rows and ``Processed`` results: data the scheduler reads, so they live here)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gdnserve.engine.cache.checkpoint_index import Checkpoint
from gdnserve.engine.cache.sequence import PrefillItem, SeqState
from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.engine.scheduling.request import Job, Request, Sample, ScoreJob

Owner = tuple[Request, Sample]


@dataclass(eq=False)
class ScoreWave:
    """Candidates of one score job in this step: ``items[k]`` is the batch item index of candidate ``cands[k]``."""
    job: ScoreJob
    cands: list[int] = field(default_factory=list)
    items: list[int] = field(default_factory=list)


@dataclass(eq=False)
class StepBatch:
    items: list[PrefillItem] = field(default_factory=list)
    owners: list[Owner | None] = field(default_factory=list)      # per item: the sample that samples after it
    decodes: list[tuple[SeqState, int]] = field(default_factory=list)
    dec_owners: list[Owner] = field(default_factory=list)
    verifies: list[tuple[SeqState, list[int]]] = field(default_factory=list)
    verified: list[Owner] = field(default_factory=list)
    temps: list[SeqState] = field(default_factory=list)              # freed after the step
    pending: list[tuple[Checkpoint, SeqState]] = field(default_factory=list)   # READY after the step
    acquired: list[Checkpoint] = field(default_factory=list)        # released after the step
    prod_chunks: list[tuple[Job, bool]] = field(default_factory=list)   # chunked producers (last chunk?)
    waves: list[ScoreWave] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)                    # every request / score job in the step
    admitted: list[Job] = field(default_factory=list)                # ... of which admitted by this step
    marks: dict = field(default_factory=dict)                        # job -> its progress() when it joined
    first_rows: list[int] = field(default_factory=list)              # per item: its first logits row
    ready: frozenset[int] = frozenset()       # READY checkpoint slots among the slots the prefills write or read
    feed: list[tuple[int, int]] = field(default_factory=list)   # (decode index, row of the in-flight step's ids)
    # chunks of a prompt_logprobs prompt: (item, request, the chunk's first prompt position, its last chunk?)
    prompt_chunks: list[tuple[int, Job, int, bool]] = field(default_factory=list)
    settled: bool = False                     # its checkpoints / temporaries / references settled already
    error: Exception | None = None            # scheduling failed part-way: this batch so far is rolled back

    def add(self, item: PrefillItem, owner: Owner | None = None) -> int:
        self.items.append(item)
        self.owners.append(owner)
        return len(self.items) - 1

    def join(self, job: Job, admitted: bool = False) -> None:
        if job not in self.marks:
            self.jobs.append(job)
            self.marks[job] = job.progress()
        if admitted and job not in self.admitted:
            self.admitted.append(job)

    @property
    def empty(self) -> bool:
        return not (self.items or self.decodes or self.verifies)

    def prefill_tokens(self) -> int:
        return sum(len(it.tokens) for it in self.items)


@dataclass(eq=False)
class Processed:
    """One step's per-request results, and its counts (the scheduler adds them to its ``EngineStats``)."""
    touched: list[Request] = field(default_factory=list)
    finished: list[tuple[Request, Sample]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    tokens: int = 0                 # tokens appended to samples
    verified: int = 0               # verify rows processed (k drafts proposed each)
    drafts_accepted: int = 0

    def finished_seqs(self) -> list:
        return [s.seq for _, s in self.finished if s.seq is not None]


@dataclass(eq=False)
class Sampled:
    """One step's sampled rows: ``tokens`` stay on the device ([B] int64, what the next step's DecodeFeed reads);
    ``result()`` waits for the one device-to-host copy and parses it per owner (token, logprob, logprobs dict)."""
    owners: list
    tokens: torch.Tensor | None
    flat: torch.Tensor | None
    event: object
    k: int

    def result(self) -> list[tuple[int, float, dict | None]]:
        if not self.owners:
            return []
        if self.event is not None:
            self.event.synchronize()
        owners, B, k = self.owners, len(self.owners), self.k
        flat = self.flat.tolist()
        toks, lps = [int(t) for t in flat[:B]], flat[B:2 * B]
        out = []
        for i, (req, _) in enumerate(owners):
            d = None
            want = req.params.logprobs
            if want is not None:
                d = {toks[i]: lps[i]}
                if k:
                    ti = flat[2 * B + i * k:2 * B + i * k + want]
                    tl = flat[2 * B + B * k + i * k:2 * B + B * k + i * k + want]
                    d.update(zip((int(x) for x in ti), tl))
            out.append((toks[i], lps[i], d))
        return out


@dataclass(eq=False)
class StepOutput:
    """A step's result: ``ran`` once the forward returned its logits; ``error``: what failed (scheduling, the
    forward, the batched sampling or its read-back); ``processed``: the per-request results of a step that did
    not fail."""
    logits: torch.Tensor | None = None
    ran: bool = False
    error: Exception | None = None
    sampling: Sampled | None = None                         # the sampled rows (ids on the device)
    accepted: list = field(default_factory=list)            # verified samples and the tokens they keep
    processed: Processed | None = None

    @property
    def dead(self) -> bool:
        """The engine cannot go on (a tensor-parallel worker is gone before the step ran): no rollback."""
        return isinstance(self.error, EngineDeadError) and not self.ran
