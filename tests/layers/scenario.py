"""A random grouped-prefill step: several producers with several consumers each, consumers of READY
checkpoints from earlier steps, plain prefills, a continued running slot, and producers continued
by their own request after the boundary."""
from __future__ import annotations

import random

from gdnserve.engine.execution.step_plan import InitFrom, PrefillSegment


def random_step(rng: random.Random, num_slots: int, ready_slots: list[int], max_len: int = 80,
                n_producers: int = 2, max_consumers: int = 3, n_plain: int = 1, n_ready_consumers: int = 2,
                n_continued: int = 1) -> list[PrefillSegment]:
    free = [s for s in range(num_slots) if s not in ready_slots]
    rng.shuffle(free)
    L = lambda: rng.randint(1, max_len)  # noqa: E731
    segs: list[PrefillSegment] = []
    for p in range(n_producers):
        segs.append(PrefillSegment(L(), InitFrom.ZEROS, free.pop(), request=f"P{p}"))
        pi = len(segs) - 1
        for c in range(rng.randint(1, max_consumers)):
            segs.append(PrefillSegment(L(), InitFrom.PRODUCER, free.pop(), producer=pi, request=f"P{p}C{c}"))
    for i in range(n_plain):
        segs.append(PrefillSegment(L(), InitFrom.ZEROS, free.pop(), request=f"plain{i}"))
    for i in range(n_continued):
        s = free.pop()
        segs.append(PrefillSegment(L(), InitFrom.OWN_SLOT, s, init_slot=s, request=f"cont{i}"))
    for i in range(n_ready_consumers):
        segs.append(PrefillSegment(L(), InitFrom.CHECKPOINT, free.pop(), init_slot=rng.choice(ready_slots),
                                   request=f"ready{i}"))
    rng.shuffle(segs_order := list(range(len(segs))))
    # shuffle segment order while keeping producer references valid
    remap = {old: new for new, old in enumerate(segs_order)}
    out = [segs[old] for old in segs_order]
    for s in out:
        if s.init is InitFrom.PRODUCER:
            s.producer = remap[s.producer]
    return out
