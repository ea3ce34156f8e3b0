"""Static inputs of prefill and mixed (prefill + decode or prefill + verify) graph steps, padded to a
:class:`MixedKey` bucket (docs/serving.md § CUDA graphs). The decode-only / verify-only buckets are graph_inputs.py's.

A step with T prefill tokens in N segments (one fused launch group, the plan's token order) and B decode or
verify requests of L tokens each (decodes: L = 1; verifies: L = k + 1, the runner's spec_tokens) runs in the
bucket (Tb, Nb, Qb, Bb, L): Tb >= T, Nb >= N, Qb >= the longest segment, Bb >= B (0: none; L is then 1). Its
rows: [0, Tb) the prefill region — the T tokens, then Tb - T padding rows; [Tb, Tb + Bb * L) the row region —
the B requests' tokens, then Bb - B padding requests of L rows. A step of decodes AND verifies beside prefill
has no bucket (it runs eagerly, as decodes and verifies together do without prefill): a speculative runner's
buckets hold verify rows or decode rows, so the grid (token x segment x query x row buckets) is at most doubled.
Every host int a kernel launch reads is the bucket's, so one graph serves every step of the bucket:

- GDN prefill: Nb + 1 sequences: the N segments (their src / dst / parent slots as the fused plan has them),
  Nb - N zero-length padding sequences (src = dst = parent = -1: the kernels exit), and one padding
  sequence over the padding rows [T, Tb) (src = dst = -1: finite outputs from token 0, no state written).
  ``chunk_indices`` is padded with sentinel rows to ceil(Tb / 64) + Nb + 1; ``max_len`` is Tb.
- Attention: Nb + 1 + Bb sequences: the N segments, Nb - N + 1 padding sequences with kv_len 0 (skipped;
  their rows' attention output is zero, ``AttnMeta.zero_out``), the B requests, and Bb - B padding requests
  (L queries at positions 0..L-1, kv_len L over page 0, as graph_inputs.py's padding). ``max_q_len`` =
  max(Qb, L).
- KV store: slot_mapping -1 on every padding row. A fork's copy-on-write tail rows (stored twice, through
  ``token_index``) ride in Nb * page_size extra entries, padded with slot -1.
- GDN decode (L = 1): slot -1 on the padding rows (zero output, no pool byte touched). GDN verify (L > 1, the
  runner's spec mode): the verify's slots, scratch / pending rows (``v_out``; replay: ``v_in`` and ``v_num``
  too), as the verify graph's (graph_inputs.py); padding requests slot -1, rows -1, num 0: nothing written.
- Logits rows: the step's rows (row-region rows shifted by Tb - T) in a [Tb + Bb * L] vector; the step reads
  its first R entries.
- With the MTP drafter (``scratch`` given: its hidden pool's scratch row, ``num_slots``), the feed pass's
  vectors (speculative/mtp.py ``MTPDrafter.mixed_feed``): per row the row of the hidden before it (``m_prev``)
  or the pool slot it comes from instead (``m_pslot``, -1: none), both in the bucket's row layout; and
  Nb + Bb commits (``m_crow`` -> ``m_cslot``: each segment's and decode's last row into its slot; a verify
  commits at acceptance). Padding rows read row 0 and store nothing (slot_mapping -1); padding commits write the
  scratch row only. A verify bucket's draft (``MTPDrafter.graph_draft``) reads the row region's own views.

All of it is ONE int32 device buffer (an IndexStager's, sized for the largest bucket at start-up, so views
keep their addresses for the runner's lifetime), filled with ONE host-to-device copy of the bucket's span.
"""
from __future__ import annotations

import bisect
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import numpy as np
import torch

from gdnserve.engine.execution.step_plan import IndexStager, PrefillSegment, fused_slots
from gdnserve.ops.varlen import CHUNK, VarlenMeta, aligned
from gdnserve.speculative.mtp import MTPStepIndex

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)   # then num_slots itself
MIN_Q = 16                     # the attention kernel's query block


def token_buckets(cap: int) -> tuple[int, ...]:
    """Prefill-token buckets up to ``cap`` (steps of about 1.5x: a step pads at most ~1/3 of its rows)."""
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"graph_max_tokens: expected an int >= 1, got {cap!r}")
    return tuple(b for b in TOKEN_BUCKETS if b < cap) + (cap,)


def _pick(buckets: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class MixedKey:
    """A prefill / mixed bucket: Tb prefill rows, Nb segments, Qb query rows per segment, Bb decode (L = 1) or
    verify (L = the runner's spec_tokens) requests of L rows each."""
    T: int
    N: int
    Q: int
    B: int
    L: int = 1

    @property
    def gdn_seqs(self) -> int:
        return self.N + 1

    @property
    def attn_seqs(self) -> int:
        return self.N + 1 + self.B

    @property
    def chunk_rows(self) -> int:
        return -(-self.T // CHUNK) + self.N + 1

    @property
    def rows(self) -> int:
        return self.T + self.B * self.L

    @property
    def verify(self) -> bool:
        return self.L > 1


def pick_mixed(tok_buckets: tuple[int, ...], seq_buckets: tuple[int, ...], dec_buckets: tuple[int, ...],
               T: int, N: int, Q: int, B: int, L: int = 1) -> MixedKey | None:
    """The smallest bucket holding the step (B requests of L rows: decodes L = 1, verifies L = k + 1), or None when
    a dimension is over its largest bucket."""
    Tb, Nb = _pick(tok_buckets, T), _pick(seq_buckets, N)
    Bb = 0 if B == 0 else _pick(dec_buckets, B)
    if Tb is None or Nb is None or Bb is None or T < 1 or N < 1:
        return None
    Qb = MIN_Q
    while Qb < Q:
        Qb *= 2
    return MixedKey(Tb, Nb, min(Qb, max(Tb, MIN_Q)), Bb, L if Bb else 1)


def _vectors(key: MixedKey, page_size: int, mtp: bool, spec_mode: str | None) -> list[tuple[str, int]]:
    M = key.rows + key.N * page_size                      # + copy-on-write duplicates
    gm = 2 * aligned(key.gdn_seqs + 1) + 2 * key.chunk_rows
    out = [("ids", key.rows), ("pos", key.rows), ("smap", M), ("tok", M), ("cu", key.attn_seqs + 1),
           ("kv", key.attn_seqs), ("gmeta", gm), ("src", key.gdn_seqs), ("dst", key.gdn_seqs),
           ("par", key.gdn_seqs), ("dslots", key.B), ("rows", key.rows)]
    if key.verify:                                        # the GDN verify's rows (VerifyMeta), per request
        out += [("v_out", key.B)] + ([("v_in", key.B), ("v_num", key.B)] if spec_mode == "replay" else [])
    if mtp:                                               # the MTP head's feed (MTPDrafter.mixed_feed)
        out += [("m_prev", key.rows), ("m_pslot", key.rows), ("m_crow", key.N + key.B), ("m_cslot", key.N + key.B)]
    return out


def _layout(key: MixedKey, W: int, page_size: int, mtp: bool = False,
            spec_mode: str | None = None) -> tuple[dict[str, tuple[int, int]], int]:
    lay, off = {}, 0
    for name, n in _vectors(key, page_size, mtp, spec_mode):
        lay[name] = (off, off + n)
        off = aligned(off + n)                            # 16-byte aligned views (ops/varlen.py ALIGN_INTS)
    lay["table"] = (off, off + key.attn_seqs * W)
    return lay, off + key.attn_seqs * W


def span(key: MixedKey, W: int, page_size: int, mtp: bool = False, spec_mode: str | None = None) -> int:
    return _layout(key, W, page_size, mtp, spec_mode)[1]


def fused_group(segs: list[PrefillSegment], ready: AbstractSet[int]) -> tuple[list[int], list[int], list[int]]:
    """The one launch group of the fused plan (step_plan.py builds it the same way, checks included: ownership
    contract and aliasing, PlanError): per segment in token order its src, dst and same-group parent."""
    return fused_slots(segs, ready)


@dataclass
class MixedStep:
    """One step's host vectors in the eager layout (the runner's StepInputs, laid out by its own code) plus the
    fused group's per-segment slots; ``fill`` pads them into the bucket."""
    ids: list[int]
    pos: list[int]
    slots: list[int]          # KV slot_mapping of the step's tokens, then of the duplicated rows
    dup_rows: list[int]
    cu: list[int]             # prefill segments' boundaries (N + 1), then one per decode / verify
    kv: list[int]
    tables: list              # PageTable per attention sequence (segments, then decodes / verifies)
    rows: list[int]           # logits rows in the eager layout
    num_prefill: int
    seg_src: list[int]
    seg_dst: list[int]
    seg_par: list[int]
    decode_slots: list[int]   # GDN slots of the row region's requests (decodes, or verifies: the key's L > 1)
    mtp: MTPStepIndex | None = None   # the MTP head's feed vectors, eager layout (None: every row padding)
    v_out: list[int] | None = None    # verifies: scratch rows (intermediate) / pending rows written (replay)
    v_in: list[int] | None = None     # replay: pending rows read
    v_num: list[int] | None = None    # replay: pending tokens applied first


class MixedInputs:
    """The persistent buffer, its per-bucket device views and GDN metas, and the per-step fill."""

    def __init__(self, max_key: MixedKey, width: int, page_size: int, device: torch.device | str,
                 scratch: int | None = None, spec_mode: str | None = None):
        """``scratch``: with the MTP drafter, its hidden pool's scratch row (padding commits go there); None:
        no MTP vectors. ``spec_mode``: the runner's verify mode (verify buckets' vectors); ``max_key``: the
        largest bucket (its L the largest too)."""
        self.width, self.page_size, self.scratch, self.spec_mode = width, page_size, scratch, spec_mode
        self.mtp = scratch is not None
        self.stager = IndexStager(max(span(replace(max_key, L=L), width, page_size, self.mtp, spec_mode)
                                      for L in (1, max_key.L)), device)
        self._views: dict[MixedKey, dict[str, torch.Tensor]] = {}

    def views(self, key: MixedKey) -> dict[str, torch.Tensor]:
        """Device int32 views at fixed addresses (see ``_vectors``); ``table`` is [attn_seqs, W]."""
        v = self._views.get(key)
        if v is None:
            lay, _ = _layout(key, self.width, self.page_size, self.mtp, self.spec_mode)
            dev = self.stager.dev
            v = {name: dev[a:b] for name, (a, b) in lay.items()}
            v["table"] = v["table"].view(key.attn_seqs, self.width)
            self._views[key] = v
        return v

    def meta(self, key: MixedKey, seqlens: list[int]) -> VarlenMeta:
        """The GDN prefill meta over the bucket's views: host ints of the bucket (num_seqs Nb + 1, chunk rows,
        num_tokens Tb, max_len Tb); ``seqlens`` (the step's padded lengths) only for the PyTorch path."""
        m = VarlenMeta.from_device(self.views(key)["gmeta"], seqlens)
        return replace(m, max_len=key.T)

    def fill(self, key: MixedKey, st: MixedStep) -> list[int]:
        """Pad ``st`` into ``key``'s layout and upload it (one copy). Returns the GDN sequence lengths."""
        lay, n = _layout(key, self.width, self.page_size, self.mtp, self.spec_mode)
        h = self.stager.stage(n).numpy()
        Tb, Nb, Bb, L, W = key.T, key.N, key.B, key.L, self.width
        T, N = st.num_prefill, len(st.seg_src)
        B = len(st.decode_slots)
        n_tok = T + B * L

        def put(name: str, live, pad) -> None:
            a, b = lay[name]
            h[a:a + len(live)] = live
            h[a + len(live):b] = pad

        def put2(name: str, pre, dec, pad_pre, pad_dec) -> None:     # [prefill region | row region]
            a, _ = lay[name]
            h[a:a + len(pre)] = pre
            h[a + len(pre):a + Tb] = pad_pre
            h[a + Tb:a + Tb + len(dec)] = dec
            h[a + Tb + len(dec):a + key.rows] = pad_dec

        put2("ids", st.ids[:T], st.ids[T:], 0, 0)
        put2("pos", st.pos[:T], st.pos[T:], 0, np.tile(np.arange(L, dtype=np.int32), Bb - B))  # padding: 0..L-1
        put2("smap", st.slots[:T], st.slots[T:n_tok], -1, -1)
        a, b = lay["smap"]                                 # then the duplicated rows' slots
        dups = st.slots[n_tok:]
        h[a + key.rows:a + key.rows + len(dups)] = dups
        h[a + key.rows + len(dups):b] = -1
        a, b = lay["tok"]
        h[a:a + key.rows] = np.arange(key.rows, dtype=np.int32)
        h[a + key.rows:a + key.rows + len(st.dup_rows)] = st.dup_rows      # prefill rows: same index here
        h[a + key.rows + len(st.dup_rows):b] = 0
        seg_cu = st.cu[:N + 1]
        dec_cu = [Tb + c - T for c in st.cu[N + 1:]]
        cu = seg_cu + [T] * (Nb - N) + [Tb] + dec_cu + list(range(Tb + (B + 1) * L, key.rows + 1, L))
        put("cu", cu, 0)
        put("kv", st.kv[:N] + [0] * (Nb - N + 1) + st.kv[N:], L)
        lens = [seg_cu[i + 1] - seg_cu[i] for i in range(N)] + [0] * (Nb - N) + [Tb - T]
        put("gmeta", VarlenMeta.host_vectors(lens, pad_chunks_to=key.chunk_rows), 0)
        put("src", st.seg_src, -1)
        put("dst", st.seg_dst, -1)
        put("par", st.seg_par, -1)
        put("dslots", st.decode_slots, -1)
        if key.verify:
            put("v_out", st.v_out or [], -1)
            if "v_in" in lay:
                put("v_in", st.v_in or [], -1)
                put("v_num", st.v_num or [], 0)
        put("rows", [r if r < T else r - T + Tb for r in st.rows], 0)
        a, b = lay["table"]
        tab = h[a:b].reshape(key.attn_seqs, W)
        for i, t in enumerate(st.tables[:N]):
            tab[i, :len(t.pages)] = t.pages
        for i, t in enumerate(st.tables[N:]):
            tab[Nb + 1 + i, :len(t.pages)] = t.pages
        tab[Nb + 1 + B:, :-(-L // self.page_size)] = 0   # padding requests read page 0 at positions < L
        if self.mtp:
            self._fill_mtp(h, lay, key, T, st.mtp)
        self.stager.push(n)
        return lens

    def _fill_mtp(self, h: np.ndarray, lay: dict[str, tuple[int, int]], key: MixedKey, T: int,
                  m: MTPStepIndex | None) -> None:
        """The feed vectors of ``m`` (eager rows: prefill [0, T), the row region from T) in the bucket's rows."""
        def row(r) -> np.ndarray:
            r = np.asarray(r, dtype=np.int64)
            return np.where(r < T, r, r - T + key.T)
        m = m or MTPStepIndex()
        a, b = lay["m_prev"]
        h[a:b] = 0
        h[a + row(np.arange(len(m.prev)))] = row(m.prev)
        a, b = lay["m_pslot"]
        h[a:b] = -1
        h[a + row(m.pool_rows)] = m.pool_slots
        a, b = lay["m_crow"]
        h[a:a + len(m.commit_rows)] = row(m.commit_rows)
        h[a + len(m.commit_rows):b] = 0
        a, b = lay["m_cslot"]
        h[a:a + len(m.commit_slots)] = m.commit_slots
        h[a + len(m.commit_slots):b] = self.scratch
