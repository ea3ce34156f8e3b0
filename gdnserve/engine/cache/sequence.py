"""A live sequence's place in the caches (``SeqState``: its GDN running slot and its attention pages) and one
prefill of it (``PrefillItem``): the data the scheduler hands the runner, here so that scheduling and the cache
name sequences without importing the runner."""
from __future__ import annotations

from dataclasses import dataclass

from gdnserve.engine.cache.page_pool import PagePool, PageTable
from gdnserve.engine.cache.state_pool import SlotKind, StatePool


@dataclass(eq=False)
class SeqState:
    """A live sequence: its GDN running slot, its attention pages, and how many tokens it has.
    Speculative decoding in replay mode: the slot lags by ``pending`` accepted tokens whose raw inputs wait in
    pending row ``slot + parity * num_slots``."""
    slot: int
    pages: PageTable
    length: int = 0
    pending: int = 0
    parity: int = 0

    @classmethod
    def open(cls, state: StatePool, pages: PagePool) -> SeqState:
        """A new sequence holding a RUNNING slot of ``state`` and an empty page table over ``pages``."""
        seq = cls(-1, PageTable(pages))
        seq.slot = state.allocate(SlotKind.RUNNING, seq)
        return seq

    def close(self, state: StatePool) -> None:
        """Give back the slot and the pages (the inverse of :meth:`open`)."""
        state.free(self.slot)
        self.pages.release()
        self.pending = 0


@dataclass
class PrefillItem:
    seq: SeqState
    tokens: list[int]
    producer: int = -1          # index of a same-step PrefillItem whose final state and KV prefix this continues
    all_logits: bool = False    # logits for every token of the item (scoring), not only the last
    start_from: tuple[int, PageTable] | None = None   # a READY checkpoint (state slot, KV pages) this continues
