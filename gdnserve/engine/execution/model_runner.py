"""Runs one step of the hybrid model: turns the step's work (prefill segments, with same-step
producer/consumer pairs, and decode tokens) into a StepPlan + attention metadata (one upload), binds
nothing per step (pools are bound to the layers once), and returns the logits of each request's last
token. The scheduler (engine loop) decides what goes into a step; this module only executes it.
"""
from __future__ import annotations

import time

import torch

from gdnserve.engine.cache.page_pool import PagePool, PagePoolConfig
from gdnserve.engine.cache.sequence import PrefillItem, SeqState
from gdnserve.engine.cache.state_pool import StatePool, StatePoolConfig
from gdnserve.engine.config import RunnerConfig
from gdnserve.engine.execution.cuda_graphs import build_step_graphs
from gdnserve.engine.execution.mixed_inputs import MixedKey, MixedStep, fused_group
from gdnserve.engine.execution.step_inputs import DecodeFeed, DeviceInputs, StepInputs
from gdnserve.engine.execution.step_plan import (
    IndexStager,
    InitFrom,
    PrefillSegment,
    build_step_plan,
    segment_phases,
)
from gdnserve.engine.execution.step_work import StepWork
from gdnserve.layers.forward_context import (
    AttnMeta,
    ForwardContext,
    VerifyMeta,
    forward_context,
)
from gdnserve.layers.moe import SparseMoE
from gdnserve.layers.rank_shapes import GDNShape, attn_heads
from gdnserve.ops.gdn.recurrent import GDNPending
from gdnserve.ops.varlen import aligned
from gdnserve.speculative.mtp import MTPDrafter, MTPStepIndex

MTP_HIDDEN = "mtp_hidden"       # the MTP drafter's per-slot hidden, registered with the state pool (checkpoint tiers)


def pool_shapes(model, rc: RunnerConfig) -> tuple[StatePoolConfig, PagePoolConfig]:
    """The state and KV page pools a model needs under ``rc`` (per rank: this rank's GDN value/key heads and
    attention KV heads; the MTP head's KV cache is one more page-pool layer after the target's)."""
    w = model.embed_tokens.weight
    if rc.spec_draft not in ("ngram", "mtp"):
        raise ValueError(f"spec_draft must be 'ngram' or 'mtp', got {rc.spec_draft!r}")
    use_mtp = rc.spec_mode is not None and rc.spec_draft == "mtp"
    if use_mtp and getattr(model, "mtp", None) is None:    # fail before any pool is allocated
        raise ValueError(f"spec_draft='mtp': this model has no MTP head: {getattr(model, 'mtp_unavailable', '')}")
    return pool_configs(model.cfg, rc, w.dtype, w.device, getattr(model, "tp_size", 1))


def pool_configs(cfg, rc: RunnerConfig, dtype: torch.dtype, device: torch.device | str = "meta",
                 tp: int = 1) -> tuple[StatePoolConfig, PagePoolConfig]:
    """:func:`pool_shapes` from the model's config alone (``cfg``: a ModelConfig; nothing is built): what the
    memory plan prices before a model is loaded (engine/memory/memory_plan.py)."""
    g, a = cfg.gdn, cfg.attn
    gs, (_, KVH) = GDNShape.of(g, tp), attn_heads(a.num_heads, a.num_kv_heads, tp)
    use_mtp = rc.spec_mode is not None and rc.spec_draft == "mtp"
    n_gdn, n_attn = cfg.num_linear_layers, cfg.num_layers - cfg.num_linear_layers
    state = StatePoolConfig(num_layers=max(1, n_gdn), num_slots=rc.num_slots, HV=gs.HV, K=gs.K,
                            V=gs.V, conv_dim=gs.conv_dim,
                            conv_width=g.conv_kernel, ssm_dtype=torch.float32, conv_dtype=dtype, device=device)
    pages = PagePoolConfig(num_layers=max(1, n_attn) + use_mtp, num_pages=rc.num_pages, page_size=rc.page_size,
                           num_kv_heads=KVH, head_dim=a.head_dim, dtype=dtype, device=device)
    return state, pages


def spec_bytes_per_slot(cfg, rc: RunnerConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes ``ModelRunner`` allocates per state slot for speculative decoding besides the pools (``_bind_spec``'s
    buffers of every GDN layer, the MTP drafter's hidden row); 0 without ``spec_mode``."""
    if rc.spec_mode is None:
        return 0
    L, act = rc.spec_tokens, dtype.itemsize
    gs = GDNShape.of(cfg.gdn, tp)
    H, HV, K, V, D = gs.H, gs.HV, gs.K, gs.V, gs.conv_dim
    if rc.spec_mode == "intermediate":      # conv scratch [S, L, D] + per-token states [S, L, HV, V, K] fp32
        per_layer = L * D * act + L * HV * V * K * 4
    else:                                   # 2 S ping-pong rows of [L, D] + GDNPending k, v, a, b
        per_layer = 2 * L * (D * act + (H * K + HV * V + 2 * HV) * act)
    mtp = cfg.hidden_size * act if rc.spec_draft == "mtp" else 0
    return cfg.num_linear_layers * per_layer + mtp


def build_pools(model, rc: RunnerConfig) -> tuple[StatePool, PagePool]:
    """Allocate the pools (the scheduler side owns them; the runner binds their tensors into the layers)."""
    sc, pc = pool_shapes(model, rc)
    return StatePool(sc), PagePool(pc)


class ModelRunner:
    def __init__(self, model, rc: RunnerConfig | None = None, pools: tuple[StatePool, PagePool] | None = None):
        """``pools``: the (state, pages) pools to bind, allocated by the caller (``build_pools``); built here
        when None (a runner on its own, as in the kernel-level tests)."""
        rc = rc or RunnerConfig()
        self.model, self.rc = model, rc
        cfg = model.cfg
        w = model.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        gdn, attn = model.gdn_layers(), model.attention_layers()
        gs = GDNShape.of(cfg.gdn, getattr(model, "tp_size", 1))
        sc, pc = pool_shapes(model, rc)
        self.state, self.pages = pools if pools is not None else (StatePool(sc), PagePool(pc))
        if self.state.config != sc or self.pages.config != pc:
            raise ValueError(f"pools: shapes {self.state.config}, {self.pages.config} do not match the model's "
                             f"{sc}, {pc}")
        use_mtp = rc.spec_mode is not None and rc.spec_draft == "mtp"
        n_attn = max(1, len(attn))
        for i, layer in enumerate(gdn):
            layer.bind_state(self.state.conv(i), self.state.ssm(i))
            layer.backend = rc.backend
        for i, layer in enumerate(attn):
            layer.bind_cache(self.pages.k_cache(i), self.pages.v_cache(i))
            layer.backend = rc.backend
        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.backend = rc.backend
        self.stager = IndexStager(rc.staging_ints, self.device)
        if rc.spec_mode is not None:
            self._bind_spec(gdn, gs)
        self.mtp = (MTPDrafter(model, rc.spec_tokens - 1, rc.num_slots, self.pages.k_cache(n_attn),
                               self.pages.v_cache(n_attn)) if use_mtp else None)
        if self.mtp is not None:
            self.mtp.head.attention.backend = rc.backend
            # hidden[slot] is part of a slot's state: a checkpoint copied to the host or disk tier carries it
            self.state.register_rows(MTP_HIDDEN, self.mtp.hidden)
        self.drafts: torch.Tensor | None = None      # [B, k] int64: the last verify step's drafts, on the device
        self.verify_slots: torch.Tensor | None = None   # [B] int32: the last verify step's slots (its upload)
        self.graphs = build_step_graphs(model, rc, self.device, self.mtp)
        self._feed: DecodeFeed | None = None     # the running step's device-fed decode tokens

    def close(self) -> None:
        """Unbind the model's layers from this runner's pools, caches and speculative buffers (idempotent). The model
        outlives its runner (a benchmark or a test builds engine after engine on one model): bound, the layers'
        views kept a dead runner's pools alive, 19.3 GiB on the H200 when bench_engine_overhead built its next
        engine. A layer another runner has bound since is left as it is."""
        ours = {t.untyped_storage().data_ptr() for t in (self.state.conv_pools, self.state.ssm_pools,
                                                          self.pages.k_pools, self.pages.v_pools)}

        def mine(t: torch.Tensor | None) -> bool:
            return t is not None and t.untyped_storage().data_ptr() in ours
        for layer in self.model.gdn_layers():
            if mine(layer.ssm_pool) or mine(layer.conv_pool):
                layer.bind_state(None, None)
                layer.bind_spec(None, None, None)
        heads = [self.mtp.head.attention] if self.mtp is not None else []
        for layer in [*self.model.attention_layers(), *heads]:
            if mine(layer.k_cache) or mine(layer.v_cache):
                layer.bind_cache(None, None)

    def capture_graphs(self) -> None:
        """Capture every bucket's decode (and verify) graph now instead of on first use (no-op without capture)."""
        if self.graphs is not None and self.graphs.capture:
            self.graphs.capture_all()

    def warm_up(self) -> str:
        """Before serving: what ``StepGraphs.warm_up`` does (every decode / verify graph captured), timed, the device
        synchronised. Returns a line for the banner ("" without graphs: CPU, tensor parallelism,
        ``--no-cuda-graphs``)."""
        if self.graphs is None:
            return ""
        t = time.perf_counter()
        n = self.graphs.warm_up()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        g = self.graphs
        rows = "verifies" if g.verify is not None else "decodes"
        steady = f", mixed steps of {g.tok_buckets[-1]} prefill tokens beside each bucket's {rows}" \
            if g.mixed is not None else ""
        what = f"{n} CUDA graphs captured (decode{' and verify' if g.verify else ''} steps, batch buckets " \
               f"{g.buckets[0]}..{g.buckets[-1]}{steady})" if g.capture else "graphs not captured"
        return f"{what}, in {time.perf_counter() - t:.1f} s"

    def _bind_spec(self, gdn, gs: GDNShape) -> None:
        """Per GDN layer: drafted raw conv inputs (scratch rows = slots in intermediate mode, ping-pong pending rows
        slot / slot + S in replay mode), per-token states (intermediate) or drafted k, v, a, b (replay)."""
        rc, S, L = self.rc, self.rc.num_slots, self.rc.spec_tokens
        if rc.spec_mode not in ("intermediate", "replay") or L < 2:
            raise ValueError(f"spec_mode must be 'intermediate' or 'replay' with spec_tokens >= 2, got "
                             f"{rc.spec_mode!r}, {L}")
        H, HV, K, V, D = gs.H, gs.HV, gs.K, gs.V, gs.conv_dim
        for layer in gdn:
            if rc.spec_mode == "intermediate":
                layer.bind_spec(torch.zeros(S, L, D, dtype=self.dtype, device=self.device),
                                torch.zeros(S, L, HV, V, K, device=self.device), None)
            else:
                layer.bind_spec(torch.zeros(2 * S, L, D, dtype=self.dtype, device=self.device), None,
                                GDNPending.empty(2 * S, L, H, HV, K, V, self.dtype, self.device))

    def _upload(self, *vecs: list[int]) -> list[torch.Tensor]:
        """Equal-length int32 vectors in one upload (flush / commit run outside the step's plan)."""
        n = len(vecs[0])
        m = aligned(n)                                   # each view 16-byte aligned (step_plan.ALIGN_INTS)
        dev = self.stager.upload([x for v in vecs for x in [*v, *[0] * (m - n)]])
        return [dev[i * m:i * m + n] for i in range(len(vecs))]

    @torch.inference_mode()
    def flush(self, seqs: list[SeqState]) -> None:
        """Replay mode: apply each sequence's pending accepted tokens to its slot (before anything but the next
        verify reads the slot). A no-op for sequences without pending tokens."""
        todo = [s for s in seqs if s.pending]
        if not todo:
            return
        S = self.rc.num_slots
        slots, rows, num = self._upload([s.slot for s in todo], [s.slot + s.parity * S for s in todo],
                                        [s.pending for s in todo])
        for layer in self.model.gdn_layers():
            layer.commit(slots, rows, num, "replay")
        for s in todo:
            s.pending = 0

    @torch.inference_mode()
    def accept(self, verified: list[tuple[SeqState, int]], counts: torch.Tensor | None = None) -> None:
        """After a verify step: sequence n keeps the first ``a_n`` of its L verify tokens (the last accepted
        token plus a_n - 1 drafts). KV of rejected positions is left to be overwritten; GDN state is committed
        (intermediate: copy the scratch row, fold conv inputs) or left pending for the next verify (replay).
        ``counts``: the same a_n on the device (acceptance's own tensor); the commit then reads them and the
        verify step's own slot vector, uploading nothing."""
        if not verified:
            return
        for seq, a in verified:
            seq.length -= self.rc.spec_tokens - a
            seq.pages.length = seq.length
        if self.mtp is not None or self.rc.spec_mode == "intermediate":
            L = self.rc.spec_tokens
            if counts is not None and self.verify_slots is not None and len(self.verify_slots) == len(verified):
                slots, num = self.verify_slots, counts.to(torch.int32)
                rows = torch.arange(0, len(verified) * L, L, device=counts.device, dtype=torch.int32) + num - 1
            else:   # one upload: slots, accepted counts, the row of the last accepted token (the MTP head's hidden)
                slots, num, rows = self._upload([s.slot for s, _ in verified], [a for _, a in verified],
                                                [b * L + a - 1 for b, (_, a) in enumerate(verified)])
            if self.mtp is not None:
                self.mtp.accept(slots.long(), rows.long())
        if self.rc.spec_mode == "intermediate":
            for layer in self.model.gdn_layers():
                layer.commit(slots, slots, num, "intermediate")
        else:
            for seq, a in verified:
                seq.pending, seq.parity = a, seq.parity ^ 1

    def new_seq(self) -> SeqState:
        return SeqState.open(self.state, self.pages)

    def free_seq(self, seq: SeqState) -> None:
        seq.close(self.state)

    @torch.inference_mode()
    def step(self, prefills: list[PrefillItem], decodes: list[tuple[SeqState, int]],
             verifies: list[tuple[SeqState, list[int]]] = (), ready: frozenset[int] = frozenset(),
             feed: DecodeFeed | None = None) -> torch.Tensor:
        """Returns fp32 logits, one row per: each prefill item's last token (every token for an item with
        ``all_logits``), then each decode token, then every token of each verify item (L rows), in order.
        After a verify step the caller must ``accept`` how many tokens each verified sequence keeps; the drafts
        that were verified are ``self.drafts`` ([B, k] on the device). Verify items carry their L tokens, or with
        ``spec_draft="mtp"`` only the last sampled token: the MTP head drafts the other k in this step.
        A decode-only or verify-only step may run a CUDA graph (``self.graphs``; with the MTP drafter its draft and
        KV passes inside it), a prefill step beside decodes or verifies too (with the MTP drafter its verify rows'
        draft and every row's feed pass inside it); its logits are the same. ``ready``: the READY checkpoint slots
        among those the prefills write or read (the scheduler's ``StepBatch.ready``), for the plan's ownership check.
        ``feed``: decode tokens that are still on the device (the overlapped loop), written over the placeholders
        the host laid out."""
        if feed is not None and (verifies or self.mtp is not None):
            raise ValueError("feed: device-fed decode tokens go with plain decode steps only")
        self._feed = feed
        try:
            return self._step(prefills, decodes, verifies, ready)
        finally:
            self._feed = None

    def _step(self, prefills, decodes, verifies, ready) -> torch.Tensor:
        if verifies and self.rc.spec_mode is None:
            raise ValueError("verifies: this runner has no spec_mode (RunnerConfig.spec_mode / spec_tokens)")
        want = 1 if self.mtp is not None else self.rc.spec_tokens     # with the MTP head: the last sampled token
        for seq, toks in verifies:
            if len(toks) != want:
                raise ValueError(f"verify: {len(toks)} tokens, the runner takes {want} per verify item "
                                 f"(spec_tokens = {self.rc.spec_tokens}, spec_draft = {self.rc.spec_draft!r})")
        self.flush([s for s, _ in decodes] + [it.seq for it in prefills])   # replay-pending state must land
        if self.graphs is not None:
            if not prefills:
                key = self.graphs.select(decodes, verifies)
                if key is not None:
                    logits = self.graphs.run(key, list(verifies or decodes), self._feed)
                    if verifies:
                        self.drafts = self.graphs.drafts(key, len(verifies))
                        self.verify_slots = self.graphs.verify_slots(key, len(verifies))
                    return logits
            else:                             # prefill beside decodes or verifies (not both)
                mkey = self.graphs.select_mixed(prefills, decodes, verifies)
                if mkey is not None:
                    return self._step_mixed(mkey, prefills, decodes, verifies, ready)
            if not prefills or self.graphs.mixed is not None:      # a step the graphs could have taken
                self.graphs.stats["fallback"] += 1
        return self.execute(self.prepare(prefills, decodes, verifies, ready))

    def prepare(self, prefills: list[PrefillItem], decodes: list[tuple[SeqState, int]], verifies,
                ready: frozenset[int] = frozenset()) -> StepWork:
        """The host half of an eager step: lay the tokens out (pages allocated, forks made) into plain host data.
        Nothing touches the device (copy-on-write page copies are listed in the work, run by ``execute``)."""
        segs = self._segments(prefills)
        host = StepInputs()
        mtp = MTPStepIndex() if self.mtp is not None else None    # the MTP head's vectors (speculative/mtp.py)
        self._lay_prefills(prefills, segs, host, mtp)
        self._lay_decodes(decodes, verifies, host, mtp)
        L = self.rc.spec_tokens
        max_q = max([len(it.tokens) for it in prefills] + [1] * bool(decodes) + [L] * bool(verifies), default=0)
        return StepWork.of(segs, host, [s.slot for s, _ in decodes], ready, len(verifies), max_q, mtp)

    @torch.inference_mode()
    def execute(self, work: StepWork, ship=None) -> torch.Tensor:
        """The device half: page copies, the plan's one upload, the forward. ``ship(work)`` (tensor parallel rank
        0) runs once the plan has validated, before the first collective."""
        if work.copies:
            self.pages.copy_pages([s for s, _ in work.copies], [d for _, d in work.copies])
        plan = build_step_plan(work.segs, self.rc.prefill_mode, self.stager, decode_slots=work.decode_slots,
                               extra=work.vectors, ready=work.ready)
        if ship is not None:
            ship(work)
        x = DeviceInputs.from_views(plan.extra, work.shape())
        L, mtp = self.rc.spec_tokens, work.mtp
        attn = AttnMeta(x.cu, x.kv, x.table, x.slots.long(), x.tok.long() if x.tok is not None else None,
                        max_q_len=work.max_q)
        vmeta = VerifyMeta(self.rc.spec_mode, L, x.v_slots, x.v_out, x.v_in, x.v_num) if work.num_verifies else None
        ctx = ForwardContext(x.pos.long(), work.num_prefill, plan.prefill, plan.decode_slots, attn, vmeta)
        ids_dev = x.ids.long()
        if self._feed is not None:
            self._feed.apply(ids_dev, work.num_prefill)
        if work.num_verifies:
            B, v0 = work.num_verifies, work.v_start
            self.drafts = ids_dev[v0:].view(B, L)[:, 1:]
            self.verify_slots = x.v_slots
            if mtp is not None:                  # k MTP steps; their drafts go into the verify rows
                meta = mtp.draft_meta(x.mtp, B, L - 1, attn.page_table[work.num_tables - B:])
                self.drafts.copy_(self.mtp.draft(ids_dev[v0::L], meta))
        with forward_context(ctx):
            if mtp is None:
                return self.model(ids_dev, x.rows.long())
            logits, hidden = self.model(ids_dev, x.rows.long(), return_hidden=True)
        self.mtp.feed(hidden, ids_dev, ctx.positions, attn, mtp.feed_meta(x.mtp, work.v_start))
        return logits

    def _step_mixed(self, key: MixedKey, prefills: list[PrefillItem], decodes: list[tuple[SeqState, int]],
                    verifies: list[tuple[SeqState, list[int]]], ready: frozenset[int]) -> torch.Tensor:
        """A prefill / mixed step through its graph bucket: the segments validated (before any page moves),
        laid out as the eager step lays them (forks, pages, lengths; verify rows and their GDN rows; the MTP
        head's feed rows too), then padded into the bucket. With verifies, ``drafts`` and ``verify_slots`` as
        the eager step leaves them (the MTP drafts made inside the graph)."""
        segs = self._segments(prefills)
        src, dst, par = fused_group(segs, ready)
        host = StepInputs()
        mtp = MTPStepIndex() if self.mtp is not None else None
        self._lay_prefills(prefills, segs, host, mtp)
        self._lay_decodes(decodes, verifies, host, mtp)
        if host.copies:                       # copy-on-write tail pages, before the graph stores this step's KV
            self.pages.copy_pages([s for s, _ in host.copies], [d for _, d in host.copies])
        st = MixedStep(host.ids, host.pos, host.slots + host.dup_slots, host.dup_rows, host.cu, host.kv,
                       host.tables, host.rows, host.num_prefill, src, dst, par,
                       host.v_slots if verifies else [s.slot for s, _ in decodes], mtp, host.v_out, host.v_in,
                       host.v_num)
        logits = self.graphs.run_mixed(key, st, self._feed)
        if verifies:
            self.drafts = self.graphs.mixed_drafts(key, len(verifies))
            self.verify_slots = self.graphs.mixed_verify_slots(key, len(verifies))
        return logits

    @staticmethod
    def _segments(prefills: list[PrefillItem]) -> list[PrefillSegment]:
        """Each prefill item's state source: a same-step producer, a READY checkpoint, its own slot, zeros."""
        segs = []
        for i, it in enumerate(prefills):
            if not it.tokens:
                raise ValueError(f"prefill {i}: no tokens")
            if (it.producer >= 0 or it.start_from is not None) and it.seq.length != 0:
                raise ValueError(f"prefill {i}: a consumer of a producer or checkpoint must be a fresh sequence")
            n, dst = len(it.tokens), it.seq.slot
            if it.producer >= 0:
                segs.append(PrefillSegment(n, InitFrom.PRODUCER, dst, producer=it.producer))
            elif it.start_from is not None:
                segs.append(PrefillSegment(n, InitFrom.CHECKPOINT, dst, init_slot=it.start_from[0]))
            elif it.seq.length > 0:
                segs.append(PrefillSegment(n, InitFrom.OWN_SLOT, dst, init_slot=dst))
            else:
                segs.append(PrefillSegment(n, InitFrom.ZEROS, dst))
        return segs

    def _fork(self, prefills: list[PrefillItem], it: PrefillItem, host: StepInputs, start_row: dict) -> None:
        """A consumer's page table: the producer's (same step) or READY checkpoint's full pages shared, the
        partial tail page private. Positions stored in earlier steps are copied (they are final); the
        producer's positions of this step are written into both pages by one store_kv (duplicated rows). The
        copies are listed in ``host.copies``: ``execute`` runs them before the step's upload."""
        if it.producer >= 0:
            prod = prefills[it.producer].seq
            child, cow = prod.pages.fork(prod.length)
            it.seq.pages, it.seq.length = child, prod.length
            if cow is None:
                return
            p_before = prod.length - len(prefills[it.producer].tokens)
            if p_before > cow.first_position:
                host.copies.append((cow.src_page, cow.dst_page))
            o0 = max(0, p_before - cow.first_position)        # the tail offsets this step stores
            r0, d0 = start_row[it.producer] + cow.first_position - p_before, cow.dst_page * cow.page_size
            host.dup_rows += range(r0 + o0, r0 + cow.num_tokens)
            host.dup_slots += range(d0 + o0, d0 + cow.num_tokens)
        elif it.start_from is not None:
            child, cow = it.start_from[1].fork(it.start_from[1].length)
            if cow is not None:
                host.copies.append((cow.src_page, cow.dst_page))
            it.seq.pages, it.seq.length = child, it.start_from[1].length

    def _lay_prefills(self, prefills: list[PrefillItem], segs: list[PrefillSegment], host: StepInputs,
                      mtp: MTPStepIndex | None) -> None:
        """Prefill tokens in the plan's order (producers first, every executor's layout); logits rows."""
        phase1, phase2 = segment_phases(segs)
        start_row: dict[int, int] = {}
        last_row: dict[int, int] = {}
        for i in phase1 + phase2:
            it = prefills[i]
            self._fork(prefills, it, host, start_row)
            row0, n, seq = len(host.ids), len(it.tokens), it.seq
            start_row[i] = row0
            if mtp is not None:      # the hidden before its first token: producer's last row, checkpoint's, own
                src = it.start_from[0] if it.start_from is not None else (seq.slot if seq.length > 0 else None)
                mtp.segment(row0, n, last_row[it.producer] if it.producer >= 0 else None,
                            None if it.producer >= 0 else src, seq.slot)
            host.add(seq, it.tokens, n)
            last_row[i] = len(host.ids) - 1
        host.num_prefill = len(host.ids)
        host.rows = [r for i, it in enumerate(prefills)
                     for r in (range(start_row[i], last_row[i] + 1) if it.all_logits else (last_row[i],))]

    def _lay_decodes(self, decodes, verifies, host: StepInputs, mtp: MTPStepIndex | None) -> None:
        """Decode tokens, then the L tokens of each verify (MTP drafts are filled in on the device later)."""
        for seq, tok in decodes:
            if mtp is not None:
                mtp.segment(len(host.ids), 1, None, seq.slot, seq.slot)
            host.add(seq, [tok], 1)
        L = self.rc.spec_tokens
        host.v_start = len(host.ids)
        for seq, toks in verifies:     # token counts were checked at the top of the step
            if mtp is not None:
                mtp.segment(len(host.ids), L, None, seq.slot, None)
                mtp.v_p0.append(seq.length)
            host.add(seq, list(toks) * L if mtp is not None else toks, L)
        host.rows += range(host.num_prefill, len(host.ids))
        if mtp is not None:
            host.mtp = mtp.extra(host.slots[host.v_start:len(host.ids)], L)
        if verifies:
            S, vs = self.rc.num_slots, [s for s, _ in verifies]
            host.v_slots = [s.slot for s in vs]
            if self.rc.spec_mode == "replay":
                host.v_in = [s.slot + s.parity * S for s in vs]
                host.v_out = [s.slot + (s.parity ^ 1) * S for s in vs]
                host.v_num = [s.pending for s in vs]
            else:
                host.v_out = list(host.v_slots)
