"""Rank 0's side of a tensor-parallel step. :class:`TPRunner` is the engine's ModelRunner: it runs every step as at
TP=1 and, once the step's plan has validated (before the first collective), ships the ``StepWork`` with the
device ops it ran since the last step (replay-mode flushes, acceptance commits: they carry slot numbers and
counts, nothing else). A worker's ``ShardRunner`` (tp_workers.py) replays those ops and executes the work on its
shard. Logits are replicated on every rank (the lm head is not sharded); rank 0 samples, the workers drop
theirs."""
from __future__ import annotations

import torch

from gdnserve.engine.cache.sequence import SeqState
from gdnserve.engine.execution.model_runner import ModelRunner
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
