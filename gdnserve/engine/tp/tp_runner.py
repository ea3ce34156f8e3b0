"""The two sides of a tensor-parallel step. Rank 0's :class:`TPRunner` is the engine's ModelRunner: it runs every
step as at TP=1 and, once the step's plan has validated (before the first collective), ships the ``StepWork``
with the device ops it ran since the last step (replay-mode flushes, acceptance commits: they carry slot numbers
and counts, nothing else). A worker's :class:`ShardRunner` replays those ops and executes the work on its shard:
the same slot and page numbers, decided by rank 0's allocators only (its own pools are never allocated from).
Logits are replicated on every rank (the lm head is not sharded); rank 0 samples, the workers drop theirs."""
from __future__ import annotations

import torch

from gdnserve.engine.cache.page_pool import PagePool, PageTable
from gdnserve.engine.cache.sequence import SeqState
from gdnserve.engine.cache.state_pool import StatePool
from gdnserve.engine.execution.model_runner import ModelRunner, pool_shapes
from gdnserve.engine.execution.step_work import StepWork
from gdnserve.engine.tp.tp_workers import TPGroup


class TPRunner(ModelRunner):
    def __init__(self, model, rc, pools, group: TPGroup):
        super().__init__(model, rc, pools=pools)
        self.group = group
        self._ops: list[tuple] = []          # device ops run on rank 0 since the last shipped step

    def flush(self, seqs: list[SeqState]) -> None:
        todo = [(s.slot, s.pending, s.parity) for s in seqs if s.pending]
        if todo:
            self._ops.append(("flush", todo))
        super().flush(seqs)

    def accept(self, verified, counts: torch.Tensor | None = None) -> None:
        if verified and (self.mtp is not None or self.rc.spec_mode == "intermediate"):   # replay: host only
            self._ops.append(("accept", [(s.slot, a) for s, a in verified]))
        super().accept(verified, counts)

    def execute(self, work: StepWork, ship=None) -> torch.Tensor:
        self.group.check()                   # a dead worker fails the step before anything runs
        shipped = False

        def send(w: StepWork) -> None:
            nonlocal shipped
            ops, self._ops = self._ops, []
            self.group.send(("step", ops, w))
            shipped = True

        try:
            return super().execute(work, ship=send)
        except Exception as e:
            if not shipped:                  # nothing left rank 0: an ordinary step failure (the engine isolates)
                raise
            raise self.group.broken(e) from e

    def close(self) -> None:
        self.group.close()


class _ShardPagePool(PagePool):
    """A worker's KV pages: tensors only. Rank 0 allocates; page numbers arrive with the work (no refcount check)."""

    def _check_used(self, page: int, what: str) -> None:
        self._check_page(page)


class ShardRunner(ModelRunner):
    def __init__(self, model, rc):
        sc, pc = pool_shapes(model, rc)
        pages = _ShardPagePool(pc)
        super().__init__(model, rc, pools=(StatePool(sc), pages))
        self._table = PageTable(pages)       # a stand-in for the sequences' tables in replayed ops

    def replay(self, ops: list[tuple], work: StepWork) -> None:
        for kind, rows in ops:
            if kind == "flush":
                self.flush([SeqState(slot, self._table, 0, pending, parity) for slot, pending, parity in rows])
            elif kind == "accept":
                self.accept([(SeqState(slot, self._table, self.rc.spec_tokens), a) for slot, a in rows])
            else:
                raise ValueError(f"unknown op {kind!r} from rank 0")
        self.execute(work)
