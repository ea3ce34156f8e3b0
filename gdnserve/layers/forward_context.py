"""The per-forward context: the one piece of global state, set around a model forward by a
context manager that refuses to nest. Layers read the step's metadata from it (built once per
step by the engine) instead of receiving it through every forward signature."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from gdnserve.layers.prefill_plan import PrefillPlan


@dataclass(frozen=True, slots=True)
class AttnMeta:
    """Attention metadata for all sequences of the step, in token order (see ops/attention)."""
    cu_seqlens_q: torch.Tensor     # [N+1] int32
    kv_lens: torch.Tensor          # [N] int32: context length incl. this step's tokens
    page_table: torch.Tensor       # [N, max_pages] int32
    slot_mapping: torch.Tensor     # [M] int64: where this step's K/V go
    token_index: torch.Tensor | None = None   # [M] int64: token of each slot (None = 0..T-1)
    kv_start: int = 0              # positions below are not attended (1 for the MTP layer's cache)
    max_q_len: int | None = None              # host bound on any sequence's query rows (None = T)
    zero_out: bool = False                    # rows no live sequence covers get a zero output (graph padding)


@dataclass(frozen=True, slots=True)
class VerifyMeta:
    """Speculative verify of B requests x L tokens (the last accepted token + L-1 drafts), built once per step.
    ``intermediate``: per-token states go to scratch rows, committed after acceptance; ``replay``: the
    previous verify's accepted tokens (pending) are applied first and the new tokens' raw inputs kept."""
    mode: str                                 # "intermediate" | "replay"
    tokens_per_req: int                       # L
    slots: torch.Tensor                       # [B] int32 GDN slots
    rows_out: torch.Tensor                    # [B] int32 scratch rows (intermediate) / pending rows written (replay)
    rows_in: torch.Tensor | None = None       # [B] int32 pending rows read (replay)
    num_pending: torch.Tensor | None = None   # [B] int32 accepted tokens of the previous verify (replay)


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Token layout of a step: ``num_prefill`` prefill tokens (in the plan's order), then one token per
    decode request, then ``tokens_per_req`` tokens per verify request."""
    positions: torch.Tensor                   # [T] int64 absolute positions (rotary)
    num_prefill: int
    prefill: PrefillPlan | None               # GDN prefill plan for tokens [0, num_prefill)
    decode_slots: torch.Tensor | None         # [B] int32 GDN slots of the decode tokens
    attn: AttnMeta | None
    verify: VerifyMeta | None = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a forward is already running")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: run the model inside `with forward_context(...)`")
    return _current
