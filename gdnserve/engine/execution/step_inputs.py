"""StepInputs: the host vectors of one eager step (token ids, positions, attention metadata, logits rows,
verify rows, the MTP head's vectors), laid out by the runner from its prefill items, decodes and verifies, and
uploaded in the step plan's single copy; ``DeviceInputs`` are their device views after it. Typed, so nothing
travels as a string-keyed dict between the runner, the plan and the forward."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from gdnserve.engine.cache.page_pool import PageTable

_VERIFY = ("v_slots", "v_in", "v_out", "v_num")


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)        # KV slot_mapping (+ duplicated copy-on-write rows)
    cu: list[int] = field(default_factory=lambda: [0])
    kv: list[int] = field(default_factory=list)
    tables: list[PageTable] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)         # logits rows
    dup_rows: list[int] = field(default_factory=list)     # token rows stored twice (a fork's tail page)
    dup_slots: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)   # (src, dst) KV pages copied before the step
    v_slots: list[int] | None = None
    v_in: list[int] | None = None
    v_out: list[int] | None = None
    v_num: list[int] | None = None
    mtp: dict[str, Sequence[int]] = field(default_factory=dict)
    num_prefill: int = 0
    v_start: int = 0

    def add(self, seq, tokens: Sequence[int], n: int) -> None:
        """Append one sequence's ``n`` tokens (its pages and length advance)."""
        p0 = seq.length
        self.slots += seq.pages.append_tokens(n)
        seq.length += n
        self.ids += tokens
        self.pos += range(p0, p0 + n)
        self.cu.append(len(self.ids))
        self.kv.append(seq.length)
        self.tables.append(seq.pages)

    @property
    def width(self) -> int:
        return max(1, max((len(t.pages) for t in self.tables), default=1))

    def vectors(self) -> dict[str, Sequence[int]]:
        """What rides in the step plan's upload, by name."""
        w = self.width
        out: dict[str, Sequence[int]] = {
            "ids": self.ids, "pos": self.pos, "slots": self.slots + self.dup_slots, "cu": self.cu, "kv": self.kv,
            "table": [p for t in self.tables for p in t.page_row(w, pad=0)], "rows": self.rows}
        if self.dup_rows:
            out["tok"] = list(range(len(self.ids))) + self.dup_rows
        out.update({k: getattr(self, k) for k in _VERIFY if getattr(self, k) is not None})
        out.update(self.mtp)
        return out


@dataclass(frozen=True)
class DeviceInputs:
    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    cu: torch.Tensor
    kv: torch.Tensor
    table: torch.Tensor
    rows: torch.Tensor
    tok: torch.Tensor | None
    v_slots: torch.Tensor | None
    v_in: torch.Tensor | None
    v_out: torch.Tensor | None
    v_num: torch.Tensor | None
    mtp: dict[str, torch.Tensor]

    @classmethod
    def from_views(cls, views: dict[str, torch.Tensor], host: StepInputs) -> DeviceInputs:
        names = {f.name for f in fields(cls)} - {"mtp"}
        kw = {n: views.get(n) for n in names}
        kw["table"] = views["table"].view(len(host.tables), host.width)
        return cls(**kw, mtp={k: v for k, v in views.items() if k in host.mtp or k == "v_slots"})


@dataclass(frozen=True)
class DecodeFeed:
    """Decode tokens still on the device (the overlapped loop: sampled by the step before and not read back yet):
    decode ``rows[i]`` of this step takes ``tokens[src[i]]``; the host laid a placeholder there. Applied to the
    step's device token ids after their upload, in stream order (eager step, decode graph, mixed graph alike)."""
    tokens: torch.Tensor      # [M] int64: the previous step's sampled ids
    rows: torch.Tensor        # [F] int64 decode indices of this step
    src: torch.Tensor         # [F] int64 indices into tokens

    @classmethod
    def of(cls, tokens: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> DecodeFeed | None:
        """``pairs``: (decode index, index into ``tokens``); None for none. One small pinned upload, no sync."""
        if not pairs:
            return None
        host = torch.tensor([p for pair in zip(*pairs) for p in pair], dtype=torch.int64)
        if tokens.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(tokens.device, non_blocking=True)
        return cls(tokens, dev[:len(pairs)], dev[len(pairs):])

    def apply(self, ids: torch.Tensor, base: int) -> None:
        """``ids[base + rows] = tokens[src]`` (decode j of the step is token row ``base + j``)."""
        ids[base + self.rows] = self.tokens[self.src].to(ids.dtype)
