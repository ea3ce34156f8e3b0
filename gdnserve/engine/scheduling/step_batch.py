"""StepBatch: what ``Scheduler.schedule()`` hands the runner and the output processor for one step, as data (the
READY checkpoint slots it touches included: the plan's ownership check reads them, no callback), and what the
step holds that must be settled after it (temporaries, checkpoints published or read, producer chunks).
StepOutput: what became of the step, for ``Scheduler.update_from_output``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gdnserve.engine.cache.checkpoint_index import Checkpoint
from gdnserve.engine.cache.sequence import PrefillItem, SeqState
from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.engine.scheduling.request import Job, Request, Sample, ScoreJob

if TYPE_CHECKING:
    from gdnserve.engine.output_processor import Processed, Sampled

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
