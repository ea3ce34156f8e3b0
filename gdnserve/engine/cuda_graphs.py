"""CUDA graphs for decode-only and verify-only steps (docs/serving.md § CUDA graphs).

A step of B requests (decode: 1 token each; verify: L = k + 1 each, either spec mode) runs the graph of
the smallest batch-size bucket Bk >= B, its rows B..Bk-1 padded so that they touch no state (see
graph_inputs.py). One graph per (kind, bucket), captured lazily on first use (or all at once by
:meth:`StepGraphs.capture_all`), every graph in one private memory pool.

What the graph holds: the model from the token ids to the final-normed hidden states of all Bk*L rows,
reading only the static views of GraphInputs (their int32 -> int64 conversions included). What stays
eager, outside the graph: the host bookkeeping (pages, lengths), the fill and its one upload, the lm head
on the B*L live rows (a fresh logits tensor each step, and no [Bk*L, vocab] buffer per graph), the
replay-mode flush before decodes and prefills, and accept/commit after a verify (they need the host's
acceptance counts; ModelRunner gives their index vectors one upload). Any other step — with prefill, with
decodes and verifies together, larger than the largest bucket, or a sequence longer than the page-table
width — runs the ordinary eager step.

``capture=False`` runs the same padded, static-buffer forward eagerly ("graph-shaped eager"): what the
CPU tests compare with the ordinary step, and what a replay must equal bit for bit on the GPU.
"""
from __future__ import annotations

from collections import Counter

import torch

from gdnserve.engine.graph_inputs import BUCKETS, GraphInputs, StepKind, graph_buckets, pick_bucket
from gdnserve.layers.forward_context import AttnMeta, ForwardContext, VerifyMeta, forward_context

Key = tuple[StepKind, int]


class StepGraphs:
    def __init__(self, model, *, buckets: tuple[int, ...], width: int, page_size: int, num_slots: int,
                 spec_mode: str | None, spec_tokens: int, capture: bool, device: torch.device):
        self.model, self.buckets, self.width, self.num_slots = model, buckets, width, num_slots
        self.decode = StepKind(1)
        self.verify = StepKind(spec_tokens, spec_mode) if spec_mode is not None else None
        kinds = [self.decode] + ([self.verify] if self.verify else [])
        self.inputs = GraphInputs(kinds, buckets[-1], width, page_size, device)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[Key, torch.Tensor] = {}
        self.stats: Counter[str] = Counter()   # replay, eager (graph-shaped), capture, fallback

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

    @torch.inference_mode()
    def run(self, key: Key, items: list) -> torch.Tensor:
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
            ids += tok if kind.verify else [tok]
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
        if self.capture:
            self.graphs[key].replay()
            h = self.hidden[key]
            self.stats["replay"] += 1
        else:
            h = self._forward(key)
            self.stats["eager"] += 1
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
        kind, Bk = key
        v = self.inputs.views(kind, Bk)
        attn = AttnMeta(v["cu"], v["kv"], v["table"], v["smap"].long(), None, max_q_len=kind.L)
        vm = None
        if kind.verify is not None:
            vm = VerifyMeta(kind.verify, kind.L, v["slots"], v["rows_out"], v.get("rows_in"), v.get("num"))
        ctx = ForwardContext(v["pos"].long(), 0, None, None if vm else v["slots"], attn, vm)
        with forward_context(ctx):
            return self.model.norm(self.model.hidden_states(v["ids"].long()))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket of every kind now, largest first (later, smaller graphs reuse the pool)."""
        for kind in (self.decode, self.verify):
            for Bk in sorted(self.buckets, reverse=True):
                if kind is not None and (kind, Bk) not in self.graphs:
                    self._capture((kind, Bk))

    def _capture(self, key: Key) -> None:
        kind, Bk = key
        empty = {name: [] for name in ("ids", "pos", "smap", *kind.row_vectors())}
        self.inputs.fill(kind, Bk, empty, [])             # all rows padding: the warm-up writes no state
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


def build_step_graphs(model, rc, device: torch.device) -> StepGraphs | None:
    """StepGraphs for a ModelRunner (``rc``: its RunnerConfig) when ``rc.cuda_graphs`` resolves on. Auto (None)
    turns them on for a CUDA device with the Triton backend, tensor parallel size 1 and a model whose forward
    can be captured (the PyTorch ops read index vectors and expert counts on the host)."""
    cuda = device.type == "cuda"
    capture = cuda if rc.graph_capture is None else rc.graph_capture
    if capture and not cuda:
        raise ValueError(f"graph_capture: CUDA graphs need a CUDA device, the model is on {device}")
    capturable = rc.backend != "torch" and all(getattr(m, "graph_safe", True) for m in model.modules())
    on = rc.cuda_graphs
    if on is None:
        on = cuda and capturable and getattr(model, "tp_size", 1) == 1
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
    return StepGraphs(model, buckets=graph_buckets(cap), width=width, page_size=rc.page_size,
                      num_slots=rc.num_slots, spec_mode=rc.spec_mode, spec_tokens=rc.spec_tokens,
                      capture=capture, device=device)
