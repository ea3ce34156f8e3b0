"""The device-side description of one step's GDN prefill, as the engine's plan builder hands it to
every GDN layer (built once per step, read by all layers; see engine/execution/step_plan.py).

A prefill is a sequence of *launch groups*. Each group is one packed launch of the conv and the
gated-delta-rule kernels over a contiguous token range of the step, with per-sequence source,
destination and (optionally) same-call parent vectors. The four grouped-prefill executors differ
only in how the builder cuts the step into groups:

    serial             one group per segment, producers first
    two_phase          phase 1 (producers + plain prefills), then state rows copied with
                       index_select / index_copy_ into private slots, then phase 2 (consumers)
                       — the reference method (vLLM PR 55876)
    two_phase_indexed  the same two groups, phase 2 reads the checkpoint slot and writes the
                       private slot by index: no copies
    fused              one group for everything; consumers name their producer as parent and the
                       state-pass kernel replays it in-register
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gdnserve.ops.varlen import VarlenMeta

PrefillMode = Literal["serial", "two_phase", "two_phase_indexed", "fused"]
PREFILL_MODES: tuple[str, ...] = ("serial", "two_phase", "two_phase_indexed", "fused")


@dataclass(frozen=True, slots=True)
class LaunchGroup:
    t0: int                        # token range [t0, t1) of the step's prefill tokens
    t1: int
    meta: VarlenMeta               # lengths of the group's sequences (cu_seqlens relative to t0)
    src: torch.Tensor              # [n] int32: initial state slot, -1 = zeros
    dst: torch.Tensor              # [n] int32: final state slot, -1 = none
    parents: torch.Tensor | None   # [n] int32: same-group parent, -1 = none (fused only)


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Reference-method copies before group ``before_group``: pool[dst[i]] = pool[src[i]]."""
    before_group: int
    src: torch.Tensor              # [C] int64: consumer_shared_state_sources
    dst: torch.Tensor              # [C] int64: private_final_state_destination


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    mode: str
    num_tokens: int
    groups: tuple[LaunchGroup, ...]
    copy: StateCopy | None = None
