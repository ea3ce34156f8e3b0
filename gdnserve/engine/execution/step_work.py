"""StepWork: one eager step's device work as plain host data, between ``ModelRunner.prepare`` (host: lay the
tokens out, allocate pages, fork) and ``ModelRunner.execute`` (device: page copies, the plan's one upload, the
forward). No tensors and no pools inside, so it pickles small: tensor-parallel rank 0 ships it to the other
ranks once per step (engine/tp/tp_workers.py), and each rank executes it on its own shard."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

from gdnserve.engine.execution.step_inputs import StepInputs
from gdnserve.engine.execution.step_plan import PrefillSegment
from gdnserve.speculative.mtp import MTPStepIndex


@dataclass(slots=True)
class StepWork:
    segs: list[PrefillSegment]
    vectors: dict[str, Sequence[int]]     # StepInputs.vectors(): what rides in the plan's upload
    decode_slots: list[int]
    ready: frozenset[int]                 # READY checkpoint slots among those the segments write or read
    copies: list[tuple[int, int]]         # copy-on-write KV pages (src, dst), copied before the upload
    num_prefill: int
    v_start: int
    num_tables: int
    width: int
    num_verifies: int
    max_q: int
    mtp: MTPStepIndex | None
    mtp_keys: tuple[str, ...] = ()       # the MTP head's vectors among ``vectors``

    @classmethod
    def of(cls, segs: list[PrefillSegment], host: StepInputs, decode_slots: list[int],
           ready: frozenset[int], num_verifies: int, max_q: int, mtp: MTPStepIndex | None) -> StepWork:
        return cls(segs, host.vectors(), decode_slots, frozenset(ready), host.copies,
                   host.num_prefill, host.v_start, len(host.tables), host.width, num_verifies, max_q, mtp, tuple(host.mtp))

    def shape(self) -> SimpleNamespace:
        """What ``DeviceInputs.from_views`` reads of the StepInputs (their page tables stay on rank 0)."""
        return SimpleNamespace(tables=range(self.num_tables), width=self.width, mtp=dict.fromkeys(self.mtp_keys))
