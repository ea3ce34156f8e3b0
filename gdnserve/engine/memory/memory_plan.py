"""Memory planning: how many KV pages and recurrent-state slots the memory left after the model holds.

Pure arithmetic on byte counts (no torch, nothing allocated): ``engine/memory/memory_budget.py`` gathers the numbers (the
device's memory, the weights, the measured or estimated activation peak) and :func:`plan` decides. The rule
(docs/serving.md § Memory planning):

    room   = budget - weights - activations - CUDA graphs - runtime reserve
    seat   = 1 slot + ceil(seat_len / page_size) pages,  seat_len = min(max_model_len, SEAT_TOKENS = 8192)
    slots  = clamp(min(room // seat, (room - pages_per_seq * page_bytes) // slot_bytes),
                   min(W, MIN_SLOTS = 4), 16 * max_num_seqs),  W = 2 * max_num_seqs + 2
    pages  = min((room - slots * slot_bytes) // page_bytes, slots * pages_per_seq)

(the second bound keeps one max_model_len sequence's pages beside the slots when seats of a shorter typical
length would not: a Hypothesis case, 5 seats of 128 pages leaving 640 of the 641 pages one 40,961-token sequence
needs). A *seat* is what one typical request holds: a slot and the KV of ``seat_len`` tokens. Sizing by seats keeps the
two pools in proportion whatever the slot costs: a GDN slot of the full-size model (61 MiB) costs as much KV as
3000 tokens, so a floor in slots (the W = 2 x max_num_seqs + 2 working slots the fixed CPU pools keep) would take
the whole room (H200, max_num_seqs 256: 514 slots = 31 GiB, KV for 2 requests). When the room holds more than W
seats, the slots beyond the running requests' hold checkpoints; when it holds fewer, the engine runs fewer
requests than max_num_seqs (admission waits for a slot) and the banner's capacity line says how many.
``seat_len`` is capped at a typical length rather than max_model_len: at the real model's 262144-token context a
seat is 5 GB of KV, so seats at max_model_len would give ~6 slots for 31 GiB although most requests are short; at
8192 tokens the slots cover that many concurrent typical requests and the rest is KV, which long requests share
(they are admitted while pages last). The peers split the same two pools: vLLM keeps one block pool (the
attention block size raised until a page holds one layer's SSM state; a request takes one block per state
group, so state and KV compete per request); SGLang splits the room by ``--mamba-full-memory-ratio`` (state : KV
bytes, default 0.9) or pins the slots with ``--max-mamba-cache-size``; here ``--num-slots`` pins them.

Pages beyond ``slots * pages_per_seq`` could never be held (every page belongs to a sequence or a checkpoint; each
holds one slot and at most pages_per_seq pages), and a small model on a large device stops at 16 slots per running
request instead of filling the device with checkpoints. An explicit ``num_pages`` / ``num_slots`` is used as given
(checked against the room, beside the other pool's least); the other pool then takes the rest by the same caps.
Every refusal is a :class:`MemoryPlanError` (a ValueError) whose message starts with the config field and its flag
and gives the bytes asked for against the bytes there are.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS_PER_SEQ = 16     # the slot cap, per running request (the working 2 + up to 14 checkpoints)
SEAT_TOKENS = 8192         # a seat's KV: a typical request (the peers' benchmark prompt), capped at max_model_len
MIN_SLOTS = 4              # the least slots a sized plan keeps: a request, its fork producer or checkpoint, spare


class MemoryPlanError(ValueError):
    """A model or a pool size that does not fit the memory budget; ``field`` is the EngineConfig field to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} (--{field.replace('_', '-')}) {message}")
        self.field = field


def fmt_bytes(n: float) -> str:
    """``1.50 GiB`` / ``320.0 KiB`` / ``12 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.{1 if unit == 'KiB' else 2}f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Budget:
    """The bytes the engine may use. ``usable`` = ``utilization x capacity - in_use`` (or a budget given in GB);
    ``field`` names the setting that sets it, for the errors; ``detail`` says what ``in_use`` is made of (CUDA: how
    much torch of this process holds beyond the counted weights, how much is outside torch's allocator)."""
    capacity: int          # the device's memory (CUDA) or the RAM available at start (CPU)
    in_use: int            # held by others when the engine started (other processes, the CUDA context)
    usable: int
    source: str            # how ``usable`` was derived, e.g. "0.90 x 139.8 GiB of cuda:0 - 0.52 GiB in use"
    field: str = "gpu_memory_utilization"
    detail: str = ""


@dataclass(frozen=True)
class Demand:
    """What the engine needs besides the pools."""
    weights: int           # parameters and buffers of the model (this rank's shard)
    activations: int       # peak of the largest step: forward, logits, sampling / prompt logprobs
    graphs: int = 0        # the CUDA graphs' private memory pool (0 without graphs)
    runtime: int = 0       # cuBLAS / Triton workspaces and allocator slack (analytic plans only)
    measured: bool = False     # activations measured by a warm-up step (else an analytic estimate)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.graphs + self.runtime


@dataclass(frozen=True)
class MemoryPlan:
    budget: Budget
    demand: Demand
    page_bytes: int        # K + V of one page over every attention layer
    slot_bytes: int        # conv + SSM state of one slot over every GDN layer (+ per-slot speculative buffers)
    num_pages: int
    num_slots: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    sized: bool            # the pools were sized from the budget (False: given sizes, only checked)

    @property
    def room(self) -> int:
        return self.budget.usable - self.demand.total

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def working_slots(self) -> int:
        return working_slots(self.max_num_seqs)

    @property
    def seat_len(self) -> int:
        return seat_len(self.max_model_len)

    def max_concurrency(self, length: int | None = None) -> int:
        """Requests that can run at once, each ``length`` tokens long (default max_model_len): KV pages, slots and
        max_num_seqs all allow it."""
        pages = -(-(length or self.max_model_len) // self.page_size)
        return min(self.max_num_seqs, self.num_slots, self.num_pages // pages)

    def checkpoint_capacity(self, prefix_len: int, running: int = 0) -> int:
        """READY checkpoints of a ``prefix_len``-token prefix that fit beside ``running`` requests at max_model_len."""
        pages = self.num_pages - running * self.pages_per_seq
        return max(0, min(self.num_slots - running, pages // max(1, -(-prefix_len // self.page_size))))

    def describe(self) -> list[str]:
        """The banner's lines."""
        b, d, pp = self.budget, self.demand, self.page_size
        prefix = max(1, self.max_model_len // 2)
        run = self.max_concurrency()
        how = "sized from the budget" if self.sized else "as configured"
        held = f": {b.detail}" if b.detail else ""
        working = min(self.working_slots, self.num_slots)
        limit = (f": the {'memory' if self.sized else 'configured pools'} hold{'s' if self.sized else ''} fewer"
                 if run < self.max_num_seqs else "")
        seat = (f"; {self.max_concurrency(self.seat_len)} at {self.seat_len} tokens each"
                if self.seat_len < self.max_model_len else "")
        memory = (f"  memory: budget {fmt_bytes(b.usable)} ({b.source}{held}): weights {fmt_bytes(d.weights)}, "
                  f"activations {fmt_bytes(d.activations)} ({'measured' if d.measured else 'estimated'}), CUDA graphs "
                  f"{fmt_bytes(d.graphs)}, runtime {fmt_bytes(d.runtime)}; pools {fmt_bytes(self.pool_bytes)} of "
                  f"{fmt_bytes(self.room)} ({how})")
        pools = (f"  pools: {self.num_slots} state slots x {fmt_bytes(self.slot_bytes)} ({working} working + "
                 f"{self.num_slots - working} for checkpoints), {self.num_pages} KV pages x "
                 f"{fmt_bytes(self.page_bytes)} ({self.num_pages * pp} tokens of {pp})")
        capacity = (f"  capacity: {run} concurrent requests at max_model_len {self.max_model_len} (state slots "
                    f"{self.num_slots}, KV for {self.num_pages // self.pages_per_seq}, max_num_seqs "
                    f"{self.max_num_seqs}{limit}){seat}; checkpoints of a {prefix}-token prefix: "
                    f"{self.checkpoint_capacity(prefix, run)} beside them, {self.checkpoint_capacity(prefix)} "
                    "when idle")
        return [memory, pools, capacity]


def working_slots(max_num_seqs: int) -> int:
    """Running samples, their fork producers and 2 spare: EngineConfig's default num_slots (the fixed CPU pools)."""
    return 2 * max_num_seqs + 2


def seat_len(max_model_len: int) -> int:
    """The tokens of KV a seat holds beside its slot: a typical request, at most max_model_len."""
    return min(max_model_len, SEAT_TOKENS)


def min_slots(max_num_seqs: int) -> int:
    """The least slots a sized plan keeps (fewer only when W itself is fewer)."""
    return min(working_slots(max_num_seqs), MIN_SLOTS)


def plan(budget: Budget, demand: Demand, *, page_bytes: int, slot_bytes: int, page_size: int, max_model_len: int,
         max_num_seqs: int, num_pages: int | None = None, num_slots: int | None = None) -> MemoryPlan:
    """The pools by the rule in the module docstring; ``num_pages`` / ``num_slots`` None = sized here.
    Raises MemoryPlanError naming the field when the model, the minimum pools or a given size does not fit."""
    for name, v in (("page_bytes", page_bytes), ("slot_bytes", slot_bytes), ("page_size", page_size),
                    ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    room = budget.usable - demand.total
    pps = -(-max_model_len // page_size)
    seat = slot_bytes + -(-seat_len(max_model_len) // page_size) * page_bytes
    least, cap = min_slots(max_num_seqs), MAX_SLOTS_PER_SEQ * max_num_seqs
    where = _where(budget, demand)
    if room <= 0:
        raise MemoryPlanError(budget.field, f"leaves no memory for the pools: the model needs "
                              f"{fmt_bytes(demand.total)} ({where}) and the budget is {fmt_bytes(budget.usable)} "
                              f"({budget.source}); {_advice(budget)}")
    def check_given(field: str, n: int, what: str, unit: int, other: int, other_what: str, other_unit: int) -> None:
        need = n * unit + other * other_unit      # a given size, beside the other pool's least
        if need > room:
            raise MemoryPlanError(field, f"= {n} asks for {n} {what} x {fmt_bytes(unit)} = {fmt_bytes(n * unit)} "
                                  f"(+ {other} {other_what} x {fmt_bytes(other_unit)}), {need} bytes; the pools have "
                                  f"{fmt_bytes(room)} ({room} bytes): budget {fmt_bytes(budget.usable)} "
                                  f"({budget.source}) - {where}")

    if num_pages is not None:
        check_given("num_pages", num_pages, "KV pages", page_bytes, num_slots if num_slots is not None else least,
                    "state slots", slot_bytes)
    if num_slots is not None:
        check_given("num_slots", num_slots, "state slots", slot_bytes, num_pages if num_pages is not None else pps,
                    "KV pages", page_bytes)
    page_cost, slot_cost = f"x {fmt_bytes(page_bytes)}", f"x {fmt_bytes(slot_bytes)}"
    if num_pages is None and num_slots is None and least * slot_bytes + pps * page_bytes > room:
        need = least * slot_bytes + pps * page_bytes
        raise MemoryPlanError(budget.field, f"leaves {fmt_bytes(room)} for the pools, less than their minimum "
                              f"{fmt_bytes(need)} ({least} state slots {slot_cost} + {pps} KV pages {page_cost} for "
                              f"one max_model_len {max_model_len} sequence); the model takes "
                              f"{fmt_bytes(demand.total)} ({where}) of {fmt_bytes(budget.usable)}; {_advice(budget)}")
    S = num_slots
    if S is None:
        left = room - (num_pages * page_bytes if num_pages is not None else 0)
        per = slot_bytes if num_pages is not None else seat
        S = max(least, min(left // per, cap))
        if num_pages is None:      # seats of a typical length may leave less than one max_model_len sequence's KV
            S = max(least, min(S, (room - pps * page_bytes) // slot_bytes))
    P = num_pages
    if P is None:
        P = max(pps, min((room - S * slot_bytes) // page_bytes, S * pps))
    return MemoryPlan(budget, demand, page_bytes, slot_bytes, P, S, page_size, max_model_len, max_num_seqs,
                      sized=num_pages is None or num_slots is None)


def _where(budget: Budget, d: Demand) -> str:
    parts = [f"weights {fmt_bytes(d.weights)}", f"activations {fmt_bytes(d.activations)}"]
    parts += [f"CUDA graphs {fmt_bytes(d.graphs)}"] * bool(d.graphs) + [f"runtime {fmt_bytes(d.runtime)}"] * bool(d.runtime)
    return " + ".join(parts)


def _advice(budget: Budget) -> str:
    raise_it = ("raise --memory-budget-gb" if budget.field == "memory_budget_gb"
                else "raise --gpu-memory-utilization")
    return (f"{raise_it}, lower --max-num-seqs / --max-model-len / --max-step-tokens, or load FP8 weights")
