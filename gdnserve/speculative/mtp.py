"""The MTP drafter: the model's own multi-token-prediction head (``models/mtp.py``) drafts k tokens per
speculating request, k sequential one-token steps batched over the step's verify requests, on the device.

The head's input at position p is the pair (h_p, x_{p+1}): the target's final hidden state after token p and
the token that follows it. Its KV cache is one more layer of the KV page pool, and the entry of pair p is
stored at position **p + 1**, i.e. in the slot of token x_{p+1}: it is written by whoever feeds x_{p+1}, in
the step that feeds it, through that step's own slot mapping. So the MTP entries follow the target's KV
exactly: shared with a checkpoint's consumers, copied with a copy-on-write tail page, rolled back with the
sequence length when drafts are rejected, freed with the pages. Position 0 holds nothing (no pair ends
there) and the head's attention starts at position 1 (``kv_start = 1``).

Each step, around the target forward (``ModelRunner.step``):

1. ``draft`` (verify steps): for each verify request with p0 tokens fed, the last sampled token x_{p0} and
   ``hidden[slot]`` = h_{p0-1}: step 1 runs pair p0-1 (rotary position p0-1, stored at position p0, attends
   positions 1..p0) and drafts d_1 = argmax; step j runs (g_{j-1}, d_{j-1}) one position further. Entries land
   in the verify's own slots, which the feed pass below then overwrites with the target's.
2. ``feed`` (every step, every row): each fed token x_r gets its pair (hidden before it, x_r) stored, the
   hidden before it being the previous row's, or for a segment's first row the hidden after its initial
   state: ``hidden[slot]`` of its own slot (a continuation, a decode, a verify) or a READY checkpoint's slot,
   or the last row of its same-step producer. Then every prefill and decode sequence's ``hidden[slot]`` becomes
   its last row's hidden; a verify's waits for acceptance (``accept``: the last accepted row).

``hidden`` is indexed like the state pool, so a published checkpoint carries "the hidden after its last
token" with its state, and a consumer of it can store the pair of its own first token; one more row (index
``num_slots``) is scratch, where a CUDA graph's padding rows commit. Index vectors come with the step's single
upload; nothing here reads the device.

Decode-only and verify-only steps run draft, target and feed inside one CUDA graph (``engine/execution/
cuda_graphs.py``): ``graph_draft`` and ``graph_feed`` derive the same index vectors on the device from the graph's
static inputs (positions, slot mapping, slots), padding rows (slot -1, slot mapping -1, positions 0..L-1) reading
finite rows and writing only the scratch row. Prefill and mixed (prefill + decode or prefill + verify) steps run
the feed inside their graph too (``mixed_feed``): their prev / pool / commit rows vary per segment, so they are
static vectors of the bucket (``engine/execution/mixed_inputs.py``), filled on the host from this step's
``MTPStepIndex`` like the others; a bucket with verify rows runs ``graph_draft`` on its row region's views first
(the same device-derived draft vectors as a verify graph's) and hands the verify rows' hidden to ``verified``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gdnserve.layers.forward_context import AttnMeta, ForwardContext, forward_context


@dataclass(frozen=True, slots=True)
class FeedMeta:
    """Index vectors of the feed pass (device, from the step's upload); T = the step's tokens."""
    prev_rows: torch.Tensor        # [T] row of the hidden before each token (any row where pool_rows says)
    pool_rows: torch.Tensor        # [F] rows whose hidden-before comes from the pool instead ...
    pool_slots: torch.Tensor       # [F] ... of these slots
    commit_rows: torch.Tensor      # [C] last rows of the prefill and decode sequences ...
    commit_slots: torch.Tensor     # [C] ... and their slots
    verify_start: int              # first verify row (verify rows run to T)


@dataclass(frozen=True, slots=True)
class DraftMeta:
    """The k draft steps of B verify requests (device, from the step's upload), step j in row j."""
    slots: torch.Tensor            # [B] state slots (hidden pool rows)
    positions: torch.Tensor        # [k, B] rotary positions p0 - 1 + j
    kv_lens: torch.Tensor          # [k, B] int32 p0 + 1 + j
    slot_mapping: torch.Tensor     # [k, B] int64 KV slot of position p0 + j
    cu_seqlens_q: torch.Tensor     # [B + 1] int32 0..B
    page_table: torch.Tensor       # [B, width] int32


class MTPStepIndex:
    """Host side of one step's MTP vectors, filled by the runner while it lays the step's tokens out; ``extra()``
    is what rides in the step's single upload, ``feed_meta`` / ``draft_meta`` the device views after it."""

    def __init__(self) -> None:
        self.prev: list[int] = []                   # per token row: the row of the hidden before it
        self.pool_rows: list[int] = []
        self.pool_slots: list[int] = []
        self.commit_rows: list[int] = []
        self.commit_slots: list[int] = []
        self.v_p0: list[int] = []                   # per verify request: tokens fed before the step

    def segment(self, row0: int, n: int, before: int | None, pool_slot: int | None, slot: int | None) -> None:
        """n token rows from row0: the hidden before the first is row ``before`` (a same-step producer's last
        row) or the pool's ``pool_slot`` (None, None: position 0, nothing before it); ``slot`` gets the last
        row's hidden after the step (None: a verify, committed at acceptance)."""
        self.prev += [row0 if before is None else before] + list(range(row0, row0 + n - 1))
        if pool_slot is not None:
            self.pool_rows.append(row0)
            self.pool_slots.append(pool_slot)
        if slot is not None:
            self.commit_rows.append(row0 + n - 1)
            self.commit_slots.append(slot)

    def extra(self, verify_slots: list[int], L: int) -> dict[str, list[int] | range]:
        """``verify_slots``: the KV slots of the verify rows (L per request), for the draft steps."""
        k, B = L - 1, len(self.v_p0)
        return {"m_prev": self.prev, "m_prows": self.pool_rows, "m_pslots": self.pool_slots,
                "m_crows": self.commit_rows, "m_cslots": self.commit_slots,
                "d_pos": [p - 1 + j for j in range(k) for p in self.v_p0],
                "d_kv": [p + 1 + j for j in range(k) for p in self.v_p0],
                "d_slot": [verify_slots[b * L + j] for j in range(k) for b in range(B)], "d_cu": range(B + 1)}

    @staticmethod
    def feed_meta(x: dict[str, torch.Tensor], verify_start: int) -> FeedMeta:
        return FeedMeta(x["m_prev"].long(), x["m_prows"].long(), x["m_pslots"].long(), x["m_crows"].long(),
                        x["m_cslots"].long(), verify_start)

    @staticmethod
    def draft_meta(x: dict[str, torch.Tensor], B: int, k: int, page_table: torch.Tensor) -> DraftMeta:
        return DraftMeta(x["v_slots"].long(), x["d_pos"].long().view(k, B), x["d_kv"].view(k, B),
                         x["d_slot"].long().view(k, B), x["d_cu"], page_table)


class MTPDrafter:
    """Drafts from ``model.mtp``; owns the per-slot hidden pool ``[num_slots + 1, hidden]`` (model dtype; the last
    row is the graph padding's scratch)."""

    def __init__(self, model, k: int, num_slots: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if getattr(model, "mtp", None) is None:
            raise ValueError(f"spec_draft='mtp': this model has no MTP head: "
                             f"{getattr(model, 'mtp_unavailable', None) or 'no mtp.* weights'}")
        if k < 1:
            raise ValueError(f"spec_k must be >= 1 for the MTP drafter, got {k}")
        self.model, self.head, self.k = model, model.mtp, k
        w = model.embed_tokens.weight
        self.num_slots = num_slots
        self.hidden = torch.zeros(num_slots + 1, model.cfg.hidden_size, dtype=w.dtype, device=w.device)
        self.head.attention.bind_cache(k_cache, v_cache)
        self.keep_logits = False                       # tests: keep each step's draft logits [k][B, vocab]
        self.logits: list[torch.Tensor] = []
        self._verify_hidden: torch.Tensor | None = None

    def draft(self, first_tokens: torch.Tensor, m: DraftMeta) -> torch.Tensor:
        """first_tokens: [B] int64, the last sampled token of each request -> drafts [B, k] int64 (greedy)."""
        embed, head, w = self.model.embed_tokens, self.head, self.model.lm_head_weight
        h, tok, out = self.hidden.index_select(0, m.slots), first_tokens, []
        self.logits = []
        for j in range(self.k):
            attn = AttnMeta(m.cu_seqlens_q, m.kv_lens[j], m.page_table, m.slot_mapping[j], None, kv_start=1)
            with forward_context(ForwardContext(m.positions[j], 0, None, None, attn)):
                h = head(embed(tok), h)
            logits = F.linear(h, w).float()
            if self.keep_logits:
                self.logits.append(logits)
            tok = logits.argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)

    def feed(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
             m: FeedMeta) -> None:
        """hidden: [T, H] the target's final hidden states of the step, ids / positions: [T] its tokens;
        ``attn``: the step's attention metadata (the MTP entries go where the tokens' KV went)."""
        before = hidden.index_select(0, m.prev_rows)
        before.index_copy_(0, m.pool_rows, self.hidden.index_select(0, m.pool_slots))
        self.head.store(self.model.embed_tokens(ids), before, positions - 1, attn.slot_mapping, attn.token_index)
        self.hidden.index_copy_(0, m.commit_slots, hidden.index_select(0, m.commit_rows))
        self._verify_hidden = hidden[m.verify_start:]

    def graph_draft(self, v: dict[str, torch.Tensor], L: int) -> None:
        """Inside a verify graph: the k drafts of every row of the bucket, written into the static ids
        (``v["ids"]``, int32 ``[Bk * L]``: row b's first token is its last sampled one, the next k the drafts). The
        draft vectors of :meth:`MTPStepIndex.extra` from the static ones: p0 = the row's first position (padding: 0,
        taken as 1 so that its attention has a key), slot mapping of step j = the row's j-th verify slot."""
        Bk, k = v["kv"].shape[0], L - 1
        ids = v["ids"].view(Bk, L)
        p0 = v["pos"].view(Bk, L)[:, 0].long().clamp(min=1)
        j = torch.arange(k, device=p0.device)[:, None]
        meta = DraftMeta(v["slots"].long().clamp(min=0), p0[None] - 1 + j, (p0[None] + 1 + j).to(torch.int32),
                         v["smap"].view(Bk, L)[:, :k].t().contiguous().long(),
                         torch.arange(Bk + 1, dtype=torch.int32, device=p0.device), v["table"])
        ids[:, 1:].copy_(self.draft(ids[:, 0].long(), meta))

    def graph_feed(self, hidden: torch.Tensor, v: dict[str, torch.Tensor], L: int, commit: bool) -> None:
        """Inside a decode (``commit``) or verify graph: :meth:`feed` for rows of L tokens each, every row's first
        hidden-before from the pool. Padding rows store nothing (slot mapping -1) and commit into the scratch row."""
        Bk = v["kv"].shape[0]
        slots = v["slots"].long()
        before = self.hidden.index_select(0, slots.clamp(min=0))
        if L > 1:
            before = torch.cat([before[:, None], hidden.view(Bk, L, -1)[:, :-1]], 1).flatten(0, 1)
        self.head.store(self.model.embed_tokens(v["ids"].long()), before, (v["pos"].long() - 1).clamp(min=0),
                        v["smap"].long(), None)
        if commit:
            self.hidden.index_copy_(0, torch.where(slots < 0, self.num_slots, slots), hidden)

    def mixed_feed(self, hidden: torch.Tensor, v: dict[str, torch.Tensor]) -> None:
        """Inside a prefill / mixed graph (decode or verify rows): :meth:`feed` from the bucket's static views
        (mixed_inputs.py): per row the row before it (``m_prev``) or its pool slot (``m_pslot`` >= 0), the step's
        own slot mapping / token index (duplicated copy-on-write rows, padding -1), and ``m_crow`` -> ``m_cslot``
        commits (padding: into the scratch row). The same values as the eager feed (copies, row-wise ops)."""
        pslot = v["m_pslot"].long()
        before = torch.where((pslot >= 0)[:, None], self.hidden.index_select(0, pslot.clamp(min=0)),
                             hidden.index_select(0, v["m_prev"].long()))
        self.head.store(self.model.embed_tokens(v["ids"].long()), before, v["pos"].long() - 1, v["smap"].long(),
                        v["tok"].long())
        self.hidden.index_copy_(0, v["m_cslot"].long(), hidden.index_select(0, v["m_crow"].long()))

    def verified(self, hidden: torch.Tensor) -> None:
        """After a verify graph's (or a mixed graph's verify rows') replay: its live verify rows' hidden states
        (``[B * L, H]``), for :meth:`accept`."""
        self._verify_hidden = hidden

    def accept(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """After a verify step: ``hidden[slots[b]]`` = the verify rows' hidden at ``rows[b]`` (row b*L + a_b - 1,
        the last accepted token of request b)."""
        self.hidden.index_copy_(0, slots, self._verify_hidden.index_select(0, rows))
        self._verify_hidden = None
