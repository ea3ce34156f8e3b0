"""The once-per-step plan: every index vector of a step, built on the host from scheduler-known
lengths and slots, uploaded with ONE host-to-device copy into a persistent buffer, read by all layers.

Prefill segments are laid out in the step's token buffer in the plan's ``order``: first every
segment that does not start from a same-step producer (plain prefills, continuations of a running
slot, and all producers), then the consumers (of a same-step producer or of a READY checkpoint).
Every executor uses that one layout, so the engine builds the token buffer once whatever the mode.
"""
from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum

import torch

from gdnserve.layers.prefill_plan import (
    PREFILL_MODES,
    LaunchGroup,
    PrefillPlan,
    StateCopy,
)
from gdnserve.ops.varlen import VarlenMeta, aligned


class PlanError(ValueError):
    """A step's segments violate the state ownership contract (architecture.md)."""


class InitFrom(Enum):
    ZEROS = "zeros"            # a fresh sequence
    OWN_SLOT = "own_slot"      # continue from a slot (usually the request's running slot)
    CHECKPOINT = "checkpoint"  # a READY checkpoint slot, read in place
    PRODUCER = "producer"      # the final state of a producer segment of the same step


@dataclass(slots=True)
class PrefillSegment:
    num_tokens: int
    init: InitFrom
    dst_slot: int                  # -1 = keep no final state
    init_slot: int = -1            # OWN_SLOT / CHECKPOINT
    producer: int = -1             # PRODUCER: index of the producer in the segment list
    request: object = None         # opaque, for error messages


@dataclass(frozen=True, slots=True)
class ReferenceVectors:
    """The four vectors of the reference design (vLLM PR 55876), device int32, token ranges in the
    plan's token layout."""
    prefix_producer_ranges: torch.Tensor           # [P, 2]
    consumer_ranges: torch.Tensor                  # [C, 2]
    consumer_shared_state_sources: torch.Tensor    # [C]
    private_final_state_destination: torch.Tensor  # [C]


@dataclass(frozen=True, slots=True)
class StepPlan:
    prefill: PrefillPlan | None
    order: tuple[int, ...]             # segment indices in token-buffer order
    reference: ReferenceVectors | None
    decode_slots: torch.Tensor | None  # [B] int32
    extra: dict[str, torch.Tensor]     # caller's own int32 vectors, uploaded in the same copy
    host_ints: int                     # how many int32 went up in the step's one copy


class IndexStager:
    """Pinned double-buffered staging + a persistent device buffer. Everything runs on one stream, so
    a step's upload is ordered after the previous step's kernels that read the same buffer."""

    def __init__(self, capacity: int, device: torch.device | str):
        self.device = torch.device(device)
        self.capacity = capacity
        pin = self.device.type == "cuda"
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def upload(self, vals: list[int]) -> torch.Tensor:
        n = len(vals)
        self.stage(n)[:] = torch.tensor(vals, dtype=torch.int32)
        return self.push(n)

    def stage(self, n: int) -> torch.Tensor:
        """The host buffer of the next upload (its first ``n`` ints), free to overwrite: callers that
        fill it in place (numpy views, persistent mirrors) then call :meth:`push`."""
        if n > self.capacity:
            raise PlanError(f"step needs {n} index ints, staging capacity is {self.capacity}")
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()   # the upload from this buffer two steps ago has landed
        return self.host[self.turn][:n]

    def push(self, n: int) -> torch.Tensor:
        """One host-to-device copy of the staged ``n`` ints; returns the device view ``dev[:n]``."""
        self.dev[:n].copy_(self.host[self.turn][:n], non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.events[self.turn] = ev
        self.turn ^= 1
        return self.dev[:n]


class _Packer:
    """Collects int vectors on the host, each at a 16-byte aligned offset (ops/varlen.py ALIGN_INTS); views are
    resolved after the single upload."""

    def __init__(self) -> None:
        self.vals: list[int] = []

    def add(self, v: Sequence[int]) -> tuple[int, int]:
        self.vals.extend([0] * (aligned(len(self.vals)) - len(self.vals)))
        start = len(self.vals)
        self.vals.extend(map(int, v))
        return start, len(self.vals)


def segment_phases(segments: Sequence[PrefillSegment]) -> tuple[list[int], list[int]]:
    """Segment indices of phase 1 (plain prefills, continuations, every producer) and phase 2 (consumers
    of a same-step producer or of a READY checkpoint). ``phase1 + phase2`` is the step's token layout."""
    producers = {s.producer for s in segments if s.init is InitFrom.PRODUCER}
    consumer = (InitFrom.CHECKPOINT, InitFrom.PRODUCER)
    phase1 = [i for i, s in enumerate(segments) if i in producers or s.init not in consumer]
    phase2 = [i for i, s in enumerate(segments) if i not in producers and s.init in consumer]
    return phase1, phase2


def build_step_plan(segments: Sequence[PrefillSegment], mode: str, stager: IndexStager, *,
                    ready: AbstractSet[int] = frozenset(),
                    decode_slots: Sequence[int] = (), extra: dict[str, Sequence[int]] | None = None) -> StepPlan:
    """Validate the segments against the ownership contract and build all device vectors of the step.
    ``ready``: the READY checkpoint slots among the slots the segments write or read (the scheduler's
    ``StepBatch.ready``; a slot not in it is taken as writable). ``extra``: more int32 vectors of
    the step (attention metadata, positions) that ride in the same single upload."""
    if mode not in PREFILL_MODES:
        raise PlanError(f"mode must be one of {PREFILL_MODES}, got {mode!r}")
    segs = list(segments)
    _validate(segs, mode, ready)
    pk = _Packer()
    packed = _pack_prefill(segs, mode, pk) if segs else None
    dec = pk.add(decode_slots)
    extra_r = {name: pk.add(v) for name, v in (extra or {}).items()}
    dev = stager.upload(pk.vals)

    def view(r: tuple[int, int]) -> torch.Tensor:
        return dev[r[0]:r[1]]

    order, prefill, reference = (), None, None
    if packed is not None:
        order, num_tokens, layout, ref = packed
        groups = tuple(LaunchGroup(rng[0], rng[1], VarlenMeta.from_device(view(m), lens), view(s), view(d),
                                   view(p) if p is not None else None)
                       for lens, m, s, d, p, rng in layout)
        copy = None
        if mode == "two_phase" and ref[2][1] > ref[2][0]:   # consumers: copy checkpoint rows first
            copy = StateCopy(before_group=len(groups) - 1, src=view(ref[2]).long(), dst=view(ref[3]).long())
        prefill = PrefillPlan(mode, num_tokens, groups, copy)
        reference = ReferenceVectors(view(ref[0]).view(-1, 2), view(ref[1]).view(-1, 2), view(ref[2]), view(ref[3]))
    return StepPlan(prefill, tuple(order), reference, view(dec) if decode_slots else None,
                    {name: view(r) for name, r in extra_r.items()}, len(pk.vals))


def _pack_prefill(segs: list[PrefillSegment], mode: str, pk: _Packer):
    """Lay the segments out (producers first), cut them into the mode's launch groups, check each group for
    aliasing, and pack every group's vectors and the four reference-design vectors into ``pk``.
    Returns (order, num_tokens, per-group packed ranges, reference-vector ranges)."""
    producers = {s.producer for s in segs if s.init is InitFrom.PRODUCER}
    phase1, phase2 = segment_phases(segs)
    order = phase1 + phase2
    pos = {seg: p for p, seg in enumerate(order)}
    start = [0]
    for i in order:
        start.append(start[-1] + segs[i].num_tokens)
    tok = {i: (start[pos[i]], start[pos[i] + 1]) for i in order}

    def shared_source(i: int) -> int:      # the slot a consumer's state comes from
        s = segs[i]
        return segs[s.producer].dst_slot if s.init is InitFrom.PRODUCER else s.init_slot

    def src_of(i: int) -> int:
        s = segs[i]
        return s.init_slot if s.init in (InitFrom.OWN_SLOT, InitFrom.CHECKPOINT) else -1

    group_specs: list[tuple[list[int], list[int], list[int], list[int] | None, tuple[int, int]]] = []
    if mode == "fused":
        parents = [pos[segs[i].producer] if segs[i].init is InitFrom.PRODUCER else -1 for i in order]
        group_specs.append((order, [src_of(i) for i in order], [segs[i].dst_slot for i in order],
                            parents if any(p >= 0 for p in parents) else None, (0, start[-1])))
    else:
        parts = [[i] for i in order] if mode == "serial" else [p for p in (phase1, phase2) if p]
        for part in parts:
            if mode == "two_phase" and part is phase2:
                srcs = [segs[i].dst_slot for i in part]   # runs in place on the private copies
            else:
                srcs = [shared_source(i) if segs[i].init is InitFrom.PRODUCER else src_of(i) for i in part]
            group_specs.append((part, srcs, [segs[i].dst_slot for i in part], None,
                                (tok[part[0]][0], tok[part[-1]][1])))
    layout = []
    for part, srcs, dsts, parents, rng in group_specs:
        _check_group_aliasing(part, srcs, dsts, parents, segs)
        lens = [segs[i].num_tokens for i in part]
        layout.append((lens, pk.add(VarlenMeta.host_vectors(lens)), pk.add(srcs), pk.add(dsts),
                       pk.add(parents) if parents is not None else None, rng))
    ref = (pk.add([x for i in phase1 if i in producers for x in tok[i]]), pk.add([x for i in phase2 for x in tok[i]]),
           pk.add([shared_source(i) for i in phase2]), pk.add([segs[i].dst_slot for i in phase2]))
    return order, start[-1], layout, ref


def fused_slots(segs: list[PrefillSegment], ready: AbstractSet[int]) -> tuple[list[int], list[int], list[int]]:
    """The fused plan's one launch group without packing anything: per segment in token order its src, dst and
    same-group parent (-1: none), after the checks ``build_step_plan`` makes (ownership contract, aliasing)."""
    _validate(segs, "fused", ready)
    phase1, phase2 = segment_phases(segs)
    order = phase1 + phase2
    pos = {seg: p for p, seg in enumerate(order)}
    own = (InitFrom.OWN_SLOT, InitFrom.CHECKPOINT)
    srcs = [segs[i].init_slot if segs[i].init in own else -1 for i in order]
    dsts = [segs[i].dst_slot for i in order]
    parents = [pos[segs[i].producer] if segs[i].init is InitFrom.PRODUCER else -1 for i in order]
    _check_group_aliasing(order, srcs, dsts, parents if any(p >= 0 for p in parents) else None, segs)
    return srcs, dsts, parents


def _validate(segs: list[PrefillSegment], mode: str, ready: AbstractSet[int]) -> None:
    dsts = [s.dst_slot for s in segs if s.dst_slot >= 0]
    if len(dsts) != len(set(dsts)):
        raise PlanError(f"a slot is the destination of two segments: {sorted(dsts)}")
    for i, s in enumerate(segs):
        who = f"segment {i} (request {s.request!r})"
        if s.num_tokens < 0:
            raise PlanError(f"{who}: num_tokens must be >= 0")
        if s.dst_slot >= 0 and s.dst_slot in ready:
            raise PlanError(f"{who}: destination slot {s.dst_slot} is a READY checkpoint")
        if s.init is InitFrom.CHECKPOINT and s.init_slot not in ready:
            raise PlanError(f"{who}: checkpoint slot {s.init_slot} is not READY")
        if s.init in (InitFrom.OWN_SLOT, InitFrom.CHECKPOINT) and s.init_slot < 0:
            raise PlanError(f"{who}: init {s.init.value} needs init_slot >= 0")
        if s.init is InitFrom.PRODUCER:
            if not 0 <= s.producer < len(segs) or s.producer == i:
                raise PlanError(f"{who}: producer {s.producer} is not another segment of the step")
            p = segs[s.producer]
            if p.init is InitFrom.PRODUCER:
                raise PlanError(f"{who}: its producer {s.producer} itself starts from a producer (one level only)")
            if p.dst_slot < 0:
                raise PlanError(f"{who}: its producer {s.producer} publishes no state (dst_slot = -1)")
            if mode == "two_phase" and s.dst_slot < 0:
                raise PlanError(f"{who}: two_phase copies into a private slot, dst_slot must be >= 0")
        if s.init is InitFrom.CHECKPOINT and mode == "two_phase" and s.dst_slot < 0:
            raise PlanError(f"{who}: two_phase copies into a private slot, dst_slot must be >= 0")


def _check_group_aliasing(part: list[int], srcs: list[int], dsts: list[int], parents: list[int] | None,
                          segs: list[PrefillSegment]) -> None:
    """Within one launch, no slot read by one sequence (directly or through its parent) may be
    written by another: the kernels give no ordering between different sequences' programs."""
    for j, p in enumerate(parents or ()):
        if p >= j or (p >= 0 and dsts[p] < 0):   # the state pass hands a parent's state over via its dst slot
            raise PlanError(f"segment {part[j]}: its producer must come first in the launch and write a slot")
    writers: dict[int, list[int]] = {}          # slot -> the launch's segments writing it (O(n), not all pairs)
    for jj, d in enumerate(dsts):
        if d >= 0:
            writers.setdefault(d, []).append(jj)
    for j, s in enumerate(srcs):
        reads = [s] if s >= 0 else []
        if parents is not None and parents[j] >= 0 and srcs[parents[j]] >= 0:
            reads.append(srcs[parents[j]])
        for r in reads:
            for jj in writers.get(r, ()):
                if jj != j:
                    raise PlanError(f"slot {r} is read by segment {part[j]} and written by segment {part[jj]} "
                                    f"in the same launch")
