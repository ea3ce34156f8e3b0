"""CUDA graphs for decode, verify, prefill and mixed steps (docs/serving.md § CUDA graphs).

Decode-only and verify-only steps: a step of B requests (decode: 1 token each; verify: L = k + 1 each, either
spec mode) runs the graph of the smallest batch-size bucket Bk >= B, its rows B..Bk-1 padded so that they
touch no state (see graph_inputs.py). With the MTP drafter the graph holds its passes too: a verify graph
drafts the k tokens (the MTP head's k steps, ``MTPDrafter.graph_draft``) into its static ids before the target
runs, and both kinds store the head's KV pairs and commit its hidden rows after it (``graph_feed``). Prefill
and mixed steps (prefill segments in one fused launch group, and decodes or verifies): the graph of the smallest
(Tb, Nb, Qb, Bb, L) bucket (prefill rows, segments, query rows per segment, decode or verify requests of L rows),
padded as mixed_inputs.py says; verify rows run the GDN verify of the runner's spec mode as the verify graph's
do. With the MTP drafter the graph drafts its verify rows' k tokens into the static ids first (``graph_draft``
on the row region's views) and runs the head's feed after the target (``MTPDrafter.mixed_feed``: every row's
pair stored, each segment's and decode's last hidden committed, from the bucket's static vectors; a verify's
hidden waits for acceptance, ``verified``). One graph per key, captured
lazily on first use (or the decode / verify ones all at once by :meth:`StepGraphs.capture_all`), every graph
in one private memory pool.

What the graph holds: the model from the token ids to the final-normed hidden states of all rows, reading
only static views (their int32 -> int64 conversions included). What stays eager, outside the graph: the host
bookkeeping (pages, lengths, a fork's page copies), the fill and its one upload, the lm head on the live
logits rows (a fresh logits tensor each step, and no [rows, vocab] buffer per graph), the replay-mode flush
before decodes and prefills, and accept/commit after a verify (they need the host's acceptance counts;
ModelRunner gives their index vectors one upload). Any other step — decodes and verifies together (with or
without prefill), a prefill mode other than ``fused``, larger than the largest bucket, or a sequence longer than
the page-table width — runs the ordinary eager step.

``capture=False`` runs the same padded, static-buffer forward eagerly ("graph-shaped eager"): what the
CPU tests compare with the ordinary step, and what a replay must equal bit for bit on the GPU.
"""
from __future__ import annotations

from collections import Counter

import torch

from gdnserve.engine.execution.graph_inputs import BUCKETS, GraphInputs, StepKind, graph_buckets, pick_bucket
from gdnserve.engine.execution.mixed_inputs import (
    SEQ_BUCKETS,
    MixedInputs,
    MixedKey,
    MixedStep,
    pick_mixed,
    token_buckets,
)
from gdnserve.layers.forward_context import AttnMeta, ForwardContext, VerifyMeta, forward_context
from gdnserve.layers.prefill_plan import LaunchGroup, PrefillPlan

Key = tuple[StepKind, int] | MixedKey


class StepGraphs:
    def __init__(self, model, *, buckets: tuple[int, ...], width: int, page_size: int, num_slots: int,
                 spec_mode: str | None, spec_tokens: int, capture: bool, device: torch.device,
                 mixed_tokens: int | None = None, mtp=None):
        """``mixed_tokens``: the largest prefill-token bucket of prefill / mixed graphs (None: none); ``mtp``: the
        runner's MTPDrafter (its passes ride in every graph: draft and feed in decode / verify ones, the feed in
        prefill / mixed ones)."""
        self.model, self.buckets, self.width, self.num_slots = model, buckets, width, num_slots
        self.mtp = mtp
        self.page_size = page_size
        self.mixed: MixedInputs | None = None
        if mixed_tokens is not None:
            self.tok_buckets = token_buckets(mixed_tokens)
            self.seq_buckets = tuple(b for b in SEQ_BUCKETS if b < num_slots) + (num_slots,)
            top = MixedKey(self.tok_buckets[-1], self.seq_buckets[-1], self.tok_buckets[-1], buckets[-1],
                           spec_tokens if spec_mode is not None else 1)
            self.mixed = MixedInputs(top, width, page_size, device, scratch=num_slots if mtp is not None else None,
                                     spec_mode=spec_mode)
        self._lens: dict[MixedKey, list[int]] = {}
        self.decode = StepKind(1)
        self.verify = StepKind(spec_tokens, spec_mode) if spec_mode is not None else None
        kinds = [self.decode] + ([self.verify] if self.verify else [])
        self.inputs = GraphInputs(kinds, buckets[-1], width, page_size, device)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[Key, torch.Tensor] = {}
        # decode / verify steps: replay, eager (graph-shaped); prefill / mixed: mixed_replay, mixed_eager (of
        # which mixed_verify had verify rows); capture; fallback: ordinary eager steps
        self.stats: Counter[str] = Counter()

    def select(self, decodes: list, verifies: list) -> Key | None:
        """The (kind, bucket) of a step without prefill, or None when it must run eagerly."""
        if bool(decodes) == bool(verifies):
            return None                                   # empty, or decodes and verifies together
        kind = self.verify if verifies else self.decode
        items = verifies or decodes
        Bk = pick_bucket(self.buckets, len(items))
        if kind is None or Bk is None:
            return None
        W, L = self.width, kind.L
        if any(len(s.pages.pages) + s.pages.pages_needed(L) > W for s, _ in items):
            return None
        return kind, Bk

    def select_mixed(self, prefills: list, decodes: list, verifies: list = ()) -> MixedKey | None:
        """The bucket of a step of ``prefills`` (PrefillItems, one fused group) and ``decodes`` or ``verifies`` (not
        both), or None: eager."""
        if self.mixed is None or not prefills or (decodes and verifies) or (verifies and self.verify is None):
            return None
        items, L = (verifies, self.verify.L) if verifies else (decodes, 1)
        lens = [len(it.tokens) for it in prefills]
        key = pick_mixed(self.tok_buckets, self.seq_buckets, self.buckets, sum(lens), len(lens), max(lens),
                         len(items), L)
        if key is None:
            return None
        cap, W = self.width * self.page_size, self.width
        for it, n in zip(prefills, lens):
            if it.producer >= 0:
                p = prefills[it.producer]
                start = p.seq.length + len(p.tokens)
            else:
                start = it.start_from[1].length if it.start_from is not None else it.seq.length
            if start + n > cap:
                return None
        if any(len(s.pages.pages) + s.pages.pages_needed(L) > W for s, _ in items):
            return None
        return key

    @torch.inference_mode()
    def run_mixed(self, key: MixedKey, st: MixedStep, feed=None) -> torch.Tensor:
        """Run a prefill / mixed step laid out by the runner (``st``: its eager-layout vectors and the fused
        group's slots; a verify bucket's: the verify vectors too): fill the bucket's static inputs, replay (or run
        graph-shaped eager), and return the fp32 logits of the step's logits rows, as the eager step would. With
        verify rows their drafts and slots are then :meth:`mixed_drafts` / :meth:`mixed_verify_slots`."""
        if self.capture and key not in self.graphs:
            self._capture(key)
        self._lens[key] = self.mixed.fill(key, st)
        if feed is not None:                              # device-fed decode tokens (step_inputs.DecodeFeed)
            feed.apply(self.mixed.views(key)["ids"], key.T)
        if self.capture:
            self.graphs[key].replay()
            h = self.hidden[key]
            self.stats["mixed_replay"] += 1
        else:
            h = self._forward(key)
            self.stats["mixed_eager"] += 1
        if key.verify:
            self.stats["mixed_verify"] += 1
            if self.mtp is not None:                      # the live verify rows' hidden, for acceptance
                self.mtp.verified(h[key.T:key.T + len(st.decode_slots) * key.L])
        return self.model.logits(h[self.mixed.views(key)["rows"][:len(st.rows)].long()])

    def mixed_drafts(self, key: MixedKey, B: int) -> torch.Tensor:
        """[B, k] int64 drafts of the verify rows of the mixed step just run (a copy, read before the next fill)."""
        return self.mixed.views(key)["ids"][key.T:key.T + B * key.L].view(B, key.L)[:, 1:].long()

    def mixed_verify_slots(self, key: MixedKey, B: int) -> torch.Tensor:
        """[B] int32 slots of the verify rows of the mixed step just run (its static input)."""
        return self.mixed.views(key)["dslots"][:B]

    @torch.inference_mode()
    def run(self, key: Key, items: list, feed=None) -> torch.Tensor:
        """Run the step of ``items`` ((seq, token) decodes or (seq, tokens) verifies, validated by the caller):
        append their KV slots, fill the static inputs, replay (or run graph-shaped eager), and return fp32
        logits of the B*L live rows, as the eager step would."""
        kind, Bk = key
        if self.capture and key not in self.graphs:
            self._capture(key)                            # before the fill: the warm-up runs on padding only
        L, S = kind.L, self.num_slots
        ids: list[int] = []
        pos: list[int] = []
        smap: list[int] = []
        kv, tables = [], []
        for seq, tok in items:
            p0 = seq.length
            smap += seq.pages.append_tokens(L)
            seq.length += L
            ids += (list(tok) * L if self.mtp is not None else tok) if kind.verify else [tok]   # MTP: drafted in-graph
            pos += range(p0, p0 + L)
            kv.append(seq.length)
            tables.append(seq.pages.pages)
        seqs = [s for s, _ in items]
        vecs = {"ids": ids, "pos": pos, "smap": smap, "kv": kv, "slots": [s.slot for s in seqs]}
        if kind.verify == "replay":
            vecs["rows_in"] = [s.slot + s.parity * S for s in seqs]
            vecs["rows_out"] = [s.slot + (s.parity ^ 1) * S for s in seqs]
            vecs["num"] = [s.pending for s in seqs]
        elif kind.verify == "intermediate":
            vecs["rows_out"] = vecs["slots"]
        self.inputs.fill(kind, Bk, vecs, tables)
        if feed is not None:                              # device-fed decode tokens (step_inputs.DecodeFeed)
            feed.apply(self.inputs.views(kind, Bk)["ids"], 0)
        if self.capture:
            self.graphs[key].replay()
            h = self.hidden[key]
            self.stats["replay"] += 1
        else:
            h = self._forward(key)
            self.stats["eager"] += 1
        if self.mtp is not None and kind.verify:
            self.mtp.verified(h[:len(items) * L])
        return self.model.logits(h[:len(items) * L])

    def drafts(self, key: Key, B: int) -> torch.Tensor:
        """[B, k] int64 drafts of the verify step just run (read from the static ids before the next fill)."""
        kind, Bk = key
        return self.inputs.views(kind, Bk)["ids"][:B * kind.L].view(B, kind.L)[:, 1:].long()

    def verify_slots(self, key: Key, B: int) -> torch.Tensor:
        """[B] int32 slots of the verify step just run (its static input: the commit reads it, no upload)."""
        kind, Bk = key
        return self.inputs.views(kind, Bk)["slots"][:B]

    def _forward(self, key: Key) -> torch.Tensor:
        """The captured region: static views in, final-normed hidden states [Bk*L, hidden] out."""
        if isinstance(key, MixedKey):
            return self._forward_mixed(key)
        kind, Bk = key
        v = self.inputs.views(kind, Bk)
        attn = AttnMeta(v["cu"], v["kv"], v["table"], v["smap"].long(), None, max_q_len=kind.L)
        vm = None
        if kind.verify is not None:
            vm = VerifyMeta(kind.verify, kind.L, v["slots"], v["rows_out"], v.get("rows_in"), v.get("num"))
        ctx = ForwardContext(v["pos"].long(), 0, None, None if vm else v["slots"], attn, vm)
        if self.mtp is not None and vm is not None:
            self.mtp.graph_draft(v, kind.L)               # the drafts into the static ids, before they are read
        with forward_context(ctx):
            h = self.model.norm(self.model.hidden_states(v["ids"].long()))
        if self.mtp is not None:
            self.mtp.graph_feed(h, v, kind.L, commit=vm is None)
        return h

    def _forward_mixed(self, key: MixedKey) -> torch.Tensor:
        """A prefill / mixed bucket's region: hidden states [Tb + Bb * L, hidden] (mixed_inputs.py's layout)."""
        v = self.mixed.views(key)
        meta = self.mixed.meta(key, self._lens[key])
        plan = PrefillPlan("fused", key.T, (LaunchGroup(0, key.T, meta, v["src"], v["dst"], v["par"]),))
        attn = AttnMeta(v["cu"], v["kv"], v["table"], v["smap"].long(), v["tok"].long(), max_q_len=max(key.Q, key.L),
                        zero_out=True)
        vm = None
        if key.verify:
            vm = VerifyMeta(self.verify.verify, key.L, v["dslots"], v["v_out"], v.get("v_in"), v.get("v_num"))
            if self.mtp is not None:                      # the drafts into the static ids, before they are read
                T, B, N = key.T, key.B, key.N
                self.mtp.graph_draft({"ids": v["ids"][T:], "pos": v["pos"][T:], "smap": v["smap"][T:T + B * key.L],
                                      "slots": v["dslots"], "kv": v["kv"][N + 1:], "table": v["table"][N + 1:]},
                                     key.L)
        ctx = ForwardContext(v["pos"].long(), key.T, plan, v["dslots"] if key.B and vm is None else None, attn, vm)
        with forward_context(ctx):
            h = self.model.norm(self.model.hidden_states(v["ids"].long()))
        if self.mtp is not None:
            self.mtp.mixed_feed(h, v)                     # padding rows store nothing, commit into the scratch row
        return h

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket of every kind now, largest first (later, smaller graphs reuse the pool)."""
        for kind in (self.decode, self.verify):
            for Bk in sorted(self.buckets, reverse=True):
                if kind is not None and (kind, Bk) not in self.graphs:
                    self._capture((kind, Bk))

    def steady_keys(self) -> list[MixedKey]:
        """The mixed buckets a loaded server lives in: one or two prompts' chunks filling the step's token budget
        (the largest token bucket, queries of one segment up to all of it) beside the decodes (a speculative
        runner: the verifies) of every batch bucket (and none), largest first. ``warm_up`` captures them so the
        first requests at each batch size do not pay a capture (and the compiles it triggers) inside their TTFT;
        other mixed keys are captured when first met, as before."""
        if self.mixed is None:
            return []
        T = self.tok_buckets[-1]
        L = self.verify.L if self.verify is not None else 1     # a speculative engine's running requests verify
        keys = [pick_mixed(self.tok_buckets, self.seq_buckets, self.buckets, T, n, T, B, L)
                for B in sorted((0, *self.buckets), reverse=True) for n in (1, 2)]
        return list(dict.fromkeys(k for k in keys if k is not None))

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Before serving (``ModelRunner.warm_up``): every decode / verify bucket and the steady-state mixed buckets
        (``steady_keys``) captured (capture on; each capture compiles its kernels first). The MTP draft is no longer
        run at every batch size here (92 s on the H200 at bucket 256): a step with verifies beside prefill drafts
        inside its mixed graph, at a bucket size, like a verify-only step. Only a step with decodes and verifies
        together still drafts eagerly at its exact B (a request that stops speculating for a step beside others that
        verify); the launch configs it meets compile in that step. Writes no state (padding rows store no KV and
        read finite rows). Returns the graphs captured."""
        n0 = self.stats["capture"]
        if self.capture:
            self.capture_all()
            for key in self.steady_keys():
                if key not in self.graphs:
                    self._capture(key)
        return self.stats["capture"] - n0

    def _capture(self, key: Key) -> None:
        if isinstance(key, MixedKey):                     # all rows padding: the warm-up writes no state
            self._lens[key] = self.mixed.fill(key, MixedStep([], [], [], [], [0], [], [], [], 0, [], [], [], []))
        else:
            kind, Bk = key
            empty = {name: [] for name in ("ids", "pos", "smap", *kind.row_vectors())}
            self.inputs.fill(kind, Bk, empty, [])
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):                     # compile every Triton kernel, set up cuBLAS
            self._forward(key)
        cur.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(key)
        self.graphs[key], self.hidden[key] = g, out
        self.stats["capture"] += 1


def build_step_graphs(model, rc, device: torch.device, mtp=None) -> StepGraphs | None:
    """StepGraphs for a ModelRunner (``rc``: its RunnerConfig) when ``rc.cuda_graphs`` resolves on. Auto (None)
    turns them on for a CUDA device with the Triton backend and a model whose forward can be captured (the
    PyTorch ops read index vectors and expert counts on the host). Tensor parallelism turns them off in
    ``EngineConfig.graphs`` (the runner config of every rank comes from it). ``mtp``: the runner's MTPDrafter."""
    cuda = device.type == "cuda"
    capture = cuda if rc.graph_capture is None else rc.graph_capture
    if capture and not cuda:
        raise ValueError(f"graph_capture: CUDA graphs need a CUDA device, the model is on {device}")
    capturable = rc.backend != "torch" and all(getattr(m, "graph_safe", True) for m in model.modules())
    on = rc.cuda_graphs
    if on is None:
        on = cuda and capturable
    if not on:
        return None
    if capture and not capturable:
        raise ValueError("cuda_graphs: this forward reads device data on the host (backend='torch', or a "
                         "module marked graph_safe=False) and cannot be captured; set cuda_graphs=False "
                         "(--no-cuda-graphs) or graph_capture=False")
    cap = rc.graph_max_batch if rc.graph_max_batch is not None else min(BUCKETS[-1], rc.num_slots)
    if not isinstance(rc.max_model_len, int) or rc.max_model_len < 1:
        raise ValueError(f"max_model_len: expected an int >= 1, got {rc.max_model_len!r}")
    width = min(rc.num_pages, -(-(rc.max_model_len + max(1, rc.spec_tokens)) // rc.page_size))
    mixed = None                                          # prefill / mixed graphs: the fused plan's one group
    if rc.mixed_graphs and rc.prefill_mode == "fused":
        mixed = rc.graph_max_tokens if rc.graph_max_tokens is not None else min(rc.max_model_len, 8192)
    return StepGraphs(model, buckets=graph_buckets(cap), width=width, page_size=rc.page_size,
                      num_slots=rc.num_slots, spec_mode=rc.spec_mode, spec_tokens=rc.spec_tokens,
                      capture=capture, device=device, mixed_tokens=mixed, mtp=mtp)
