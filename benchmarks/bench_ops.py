"""Op benchmarks: gdnserve's conv + chunked prefill, decode and verify, against fla 0.6.0.

Run ``gdnserve bench ops`` or ``python -m benchmarks.bench_ops`` (options: --device, --quick, --out,
--no-fla; ``python -m benchmarks.bench_ops`` also --only KIND[:SIZES] and --prefill-shapes NxL,...). Writes
``ops_<device>_<date>.json`` and ``.md`` to --out (rewritten after every case, so a run cut short keeps what it
measured; committed as ``benchmarks/results/ops_<device>.*``, the newest only) and prints the table.

Workloads on CUDA: the GDN layer of Qwen3.5-35B-A3B (H=16, HV=32, K=V=128, W=4, D=8192), bf16
activations, fp32 state pool ``[S, HV, V, K]``. q/k/v are column slices of the conv output; slots are
random and distinct, drawn from a pool larger than the batch; inputs are fresh random data (never
zeros); A_log = log U(1, 16), dt_bias = U(0, 1).

* prefill N x L in {1x8192, 1x32768, 8x4096, 64x256} (or --prefill-shapes): conv + chunked GDN, each sequence from pool
  slot ``src`` to slot ``dst`` (``src != dst``, so repeated calls do the same work).
* decode B in {1, 32, 256, 1024}, in place on the pool slots.
* verify B in {1, 64, 256}, L = 4 tokens per request: ``intermediate`` (verify + commit of a random
  accepted count) and ``replay`` (replays 1..L pending tokens of the previous step, then verifies).

fla rows use fla-core 0.6.0 with its fastest fused options (q/k l2norm, gates and beta sigmoid in the
kernel, V-major state via ``state_v_first``) and precomputed chunk indices, so its host sync is not
timed. ``fla``: contiguous initial states prepared outside the timed region, final states returned
and never stored (a lower bound for fla). ``fla+gather/scatter``: the vLLM-style ``index_select`` of
the pooled states before and ``index_copy_`` after, as ``../shared/anchors/fla_anchor.py`` does.
fla's decode/verify inputs are contiguous (what vLLM's fused post-conv kernel produces); its prefill
takes views of its own conv output, as the anchor does.

Essential bytes and FLOPs (each input read once, each output written once, the state read and
written once per request; s_a = 2 (bf16), s_s = 4 (fp32), C = 64):

  conv prefill    bytes = (2 T D + D W + 2 N (W-1) D) s_a                FLOPs = 2 W T D
  chunk prefill   bytes = T (2 H K + 2 HV V + 2 HV) s_a + 2 N HV V K s_s
                  FLOPs = T HV (4 C K + 2 C (K+V) + 2 C V + 6 K V + C^2/3)   (gdn_kernels.md §2.3:
                  K K^T, solve, W/U, state pass, output; ~182 K per token and value head at K=V=128)
  prefill row     conv + chunk (the conv output counted written once and read once)
  decode/verify   bytes = B L (2 H K + 2 HV V + 2 HV) s_a + 2 B HV V K s_s + 4 B
                  FLOPs = 7 B L HV K V   (decay, S^T k, rank-1 update, S^T q)

Every implementation of a case is held to the same essential count, so TB/s compares useful work:
intermediate verify (L+1 states per request) and fla+gather/scatter (three state round trips) show
their extra traffic as a lower achieved TB/s. The floor is max(bytes / copy rate, FLOPs / bf16 rate).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from benchmarks.timing import host_time, measure_ceilings, time_call
from benchmarks import jsonfmt

REPO_ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64
ACT, STATE = torch.bfloat16, torch.float32
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench ops {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Dims:
    H: int
    HV: int
    K: int
    V: int
    W: int

    @property
    def D(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V


QWEN35_GDN = Dims(H=16, HV=32, K=128, V=128, W=4)
TINY = Dims(H=2, HV=4, K=32, V=32, W=4)


@dataclass(frozen=True)
class Plan:
    dims: Dims
    prefill: tuple[tuple[int, int], ...]   # (N sequences, L tokens each)
    decode: tuple[int, ...]                # B
    verify: tuple[int, ...]                # B, at VERIFY_L tokens per request
    iters: int
    warmup: int
    host_iters: int


VERIFY_L = 4
NAIVE_BUDGET = 1 << 30   # tokens * HV * K * V of the float64 reference check (about 2k tokens at Qwen3.5)


def make_plan(cuda: bool, quick: bool) -> Plan:
    if cuda and not quick:
        return Plan(QWEN35_GDN, ((1, 8192), (1, 32768), (8, 4096), (64, 256)), (1, 32, 256, 1024), (1, 64, 256),
                    iters=50, warmup=3, host_iters=200)
    if cuda:  # the shapes the targets name
        return Plan(QWEN35_GDN, ((1, 32768),), (1, 256), (256,), iters=20, warmup=2, host_iters=50)
    if not quick:
        return Plan(TINY, ((1, 256), (4, 64)), (1, 8), (1, 8), iters=5, warmup=1, host_iters=5)
    return Plan(TINY, ((2, 64),), (2,), (2,), iters=3, warmup=1, host_iters=3)


# ------------------------------------------------------------------------------------------- costs

def conv_cost(d: Dims, T: int, N: int, s_a: int = 2) -> tuple[int, int]:
    return (2 * T * d.D + d.D * d.W + 2 * N * (d.W - 1) * d.D) * s_a, 2 * d.W * T * d.D


def chunk_cost(d: Dims, T: int, N: int, s_a: int = 2, s_s: int = 4) -> tuple[int, int]:
    nbytes = T * (2 * d.H * d.K + 2 * d.HV * d.V + 2 * d.HV) * s_a + 2 * N * d.HV * d.V * d.K * s_s
    per_tok = 4 * CHUNK * d.K + 2 * CHUNK * (d.K + d.V) + 2 * CHUNK * d.V + 6 * d.K * d.V + CHUNK ** 2 / 3
    return nbytes, int(T * d.HV * per_tok)


def recurrent_cost(d: Dims, B: int, L: int, s_a: int = 2, s_s: int = 4) -> tuple[int, int]:
    nbytes = B * L * (2 * d.H * d.K + 2 * d.HV * d.V + 2 * d.HV) * s_a + 2 * B * d.HV * d.V * d.K * s_s + 4 * B
    return nbytes, 7 * B * L * d.HV * d.K * d.V


# ------------------------------------------------------------------------------------ implementations

def load_ours() -> SimpleNamespace:
    """gdnserve's ops, imported lazily so the CLI works while they are being written."""
    from gdnserve.ops.conv import causal_conv1d_prefill
    from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
    from gdnserve.ops.gdn.recurrent import (GDNPending, gdn_commit_intermediate, gdn_decode, gdn_verify,
                                            prepare_decode, prepare_verify)
    from gdnserve.ops.gdn.recurrent_triton import recurrent_plan
    from gdnserve.ops.launch import Prepared
    from gdnserve.ops.varlen import VarlenMeta
    try:  # optional: a preallocated chunk workspace, as the engine keeps one per token bucket
        from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
    except ImportError:
        ChunkWorkspace = None

    def prepared_plan(*args, **overrides):   # a config variant: the planner's overrides, launched prepared
        fn, grid, targs, nw, key = recurrent_plan(*args[:17], float(args[0].shape[-1] ** -0.5), args[17],
                                                  **overrides)
        return Prepared(fn, grid, targs, nw, key=key)

    return SimpleNamespace(conv=causal_conv1d_prefill, chunk=chunk_gated_delta_rule, decode=gdn_decode,
                           verify=gdn_verify, commit=gdn_commit_intermediate, Pending=GDNPending, Meta=VarlenMeta,
                           Workspace=ChunkWorkspace, prepare_decode=prepare_decode, prepare_verify=prepare_verify,
                           prepared_plan=prepared_plan)


class Fla:
    """fla 0.6.0 called the way a serving engine would: one packed batch, V-major fp32 states."""

    def __init__(self) -> None:
        import fla
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices
        self.version = getattr(fla, "__version__", "?")
        self._conv, self._chunk, self._rec = causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self._indices = prepare_chunk_indices
        self.gates_in_kernel = True
        self.note = "gates, beta sigmoid and q/k l2norm in fla's kernels"
        self._proven: set[str] = set()   # entry points whose in-kernel-gate call has succeeded once

    def varlen(self, seqlens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cu_seqlens (int64) and chunk indices, built once here so no call reads lengths back."""
        cu_cpu = torch.tensor([0] + [sum(seqlens[: i + 1]) for i in range(len(seqlens))], dtype=torch.long)
        cu = cu_cpu.to(device)
        return cu, self._indices(cu, CHUNK, cu_seqlens_cpu=cu_cpu).to(device)

    def _with_gates(self, kind: str, call: Callable[..., Any], a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, **kw: Any) -> Any:
        """Raw a, b with fla's in-kernel gates; if the very first such call of an entry point fails and
        the same call with gates computed in torch works, keep the torch gates and say so."""
        from gdnserve.ops.gdn.gates import gates
        if self.gates_in_kernel:
            try:
                out = call(g=a, beta=b, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, **kw)
                self._proven.add(kind)
                return out
            except Exception as e:  # noqa: BLE001
                if kind in self._proven:
                    raise
                g, beta = gates(a, b, A_log, dt_bias)
                out = call(g=g, beta=beta.to(a.dtype), **kw)   # raises if fla fails for another reason
                self.gates_in_kernel = False
                self.note = f"in-kernel gates failed ({type(e).__name__}: {e}); gates computed in torch"
                log(f"fla: {self.note}")
                return out
        g, beta = gates(a, b, A_log, dt_bias)
        return call(g=g, beta=beta.to(a.dtype), **kw)

    def conv(self, x, weight, init, cu, ci):
        """x [1, T, D]; init [N, D, W] (fla keeps W columns, the last W-1 are the history)."""
        return self._conv(x, weight=weight, initial_state=init, output_final_state=True, activation="silu",
                          cu_seqlens=cu, chunk_indices=ci)

    def chunk(self, q, k, v, a, b, A_log, dt_bias, init, cu, ci):
        return self._with_gates("chunk", lambda **kw: self._chunk(q, k, v, **kw), a, b, A_log, dt_bias,
                                initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                state_v_first=True, cu_seqlens=cu, chunk_indices=ci)

    def recurrent(self, q, k, v, a, b, A_log, dt_bias, init):
        """q, k [B, L, H, K]; v [B, L, HV, V]; a, b [B, L, HV]; init [B, HV, V, K]."""
        return self._with_gates("recurrent", lambda **kw: self._rec(q, k, v, **kw), a, b, A_log, dt_bias,
                                initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                state_v_first=True)


# ----------------------------------------------------------------------------------------- cases

@dataclass
class Impl:
    name: str
    fn: Callable[[Any], Any]
    parts: dict[str, Callable[[Any], Any]]   # public op calls inside fn, timed alone for host cost
    ours: bool
    baseline: bool = False                   # the row the ÷fla ratios divide by


@dataclass
class Case:
    kind: str                      # prefill | decode | verify
    label: str                     # e.g. 1x32768, B=256, B=256 L=4
    params: dict[str, Any]
    nbytes: int
    flops: int
    sets: list[Any]                # input sets, rotated
    impls: list[Impl] = field(default_factory=list)
    prepare: Callable[[], None] | None = None                         # runs once before check and timing
    check: Callable[[], tuple[str, dict[str, float]]] | None = None   # -> (reference name, rel-RMS by tensor)


@dataclass
class Ctx:
    plan: Plan
    device: torch.device
    ours: SimpleNamespace | None
    fla: Fla | None
    l2_bytes: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def naive_ok(self, tokens: int) -> bool:
        """The float64 reference loops over tokens on the CPU: only where it takes seconds."""
        d = self.plan.dims
        return tokens * d.HV * d.K * d.V <= NAIVE_BUDGET

    def n_sets(self, nbytes: int) -> int:
        """Input sets to rotate so consecutive calls do not hit in L2 (3x L2 of distinct data)."""
        return 1 if not self.cuda else max(1, min(16, math.ceil(3 * self.l2_bytes / max(nbytes, 1))))


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64, computed on x's device (gdnserve.ops.numerics.rel_rms without the
    trip to the CPU, which is slow for a 32k-token output)."""
    x64, r64 = x.detach().double(), ref.detach().double().to(x.device)
    if not torch.isfinite(x64).all():
        return float("inf")
    den = r64.norm().item()
    return (x64 - r64).norm().item() / den if den > 0 else (x64 - r64).norm().item()


def _randn(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=dev) * scale).to(dtype)


def _layer_params(d: Dims, dev: torch.device) -> SimpleNamespace:
    return SimpleNamespace(conv_w=_randn((d.D, d.W), ACT, dev, 0.3),
                           A_log=torch.empty(d.HV, device=dev).uniform_(1, 16).log(),
                           dt_bias=torch.rand(d.HV, device=dev))


def split_qkv(y: torch.Tensor, d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column views of a conv output [..., D] as q, k [..., H, K] and v [..., HV, V] (no copies)."""
    lead = y.shape[:-1]
    hk = d.H * d.K
    return (y[..., :hk].view(*lead, d.H, d.K), y[..., hk:2 * hk].view(*lead, d.H, d.K),
            y[..., 2 * hk:].view(*lead, d.HV, d.V))


def _conv_ref(x: torch.Tensor, w: torch.Tensor, hist: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """Float64 causal conv + SiLU per sequence; hist [N, W-1, D] oldest first (CPU sanity reference)."""
    out, t = [], 0
    W = w.shape[1]
    for n, L in enumerate(seqlens):
        xx = torch.cat([hist[n].double(), x[t:t + L].double()])
        y = sum(w[:, m].double() * xx[m:m + L] for m in range(W))
        out.append(torch.nn.functional.silu(y))
        t += L
    return torch.cat(out)


def build_prefill(ctx: Ctx, N: int, L: int) -> Case:
    d, dev, ours, fla = ctx.plan.dims, ctx.device, ctx.ours, ctx.fla
    seqlens, T = [L] * N, N * L
    cb, cf = conv_cost(d, T, N)
    gb, gf = chunk_cost(d, T, N)
    case = Case("prefill", f"{N}x{L}", {"N": N, "L": L, "T": T}, cb + gb, cf + gf, [])
    n_sets = ctx.n_sets(case.nbytes)
    S = max(4 * N * n_sets, 8)
    perm = torch.randperm(S, device=dev).to(torch.int32)
    p = _layer_params(d, dev)
    ssm_pool = _randn((S, d.HV, d.V, d.K), STATE, dev, 0.05)
    conv_pool = _randn((S, d.W - 1, d.D), ACT, dev)
    fla_ssm = ssm_pool.clone()
    fla_conv = torch.empty(S, d.D, d.W, device=dev, dtype=ACT)
    fla_conv[:, :, 0] = _randn((S, d.D), ACT, dev)
    fla_conv[:, :, 1:] = conv_pool.transpose(1, 2)
    for i in range(n_sets):
        src, dst = perm[2 * i * N:(2 * i + 1) * N], perm[(2 * i + 1) * N:(2 * i + 2) * N]
        s = SimpleNamespace(src=src, dst=dst, src_l=src.long(), dst_l=dst.long(), x=_randn((T, d.D), ACT, dev),
                            a=_randn((T, d.HV), ACT, dev), b=_randn((T, d.HV), ACT, dev),
                            y=torch.empty(T, d.D, device=dev, dtype=ACT),
                            o=torch.empty(T, d.HV, d.V, device=dev, dtype=ACT))
        s.conv_init, s.ssm_init = fla_conv[s.src_l].contiguous(), fla_ssm[s.src_l].contiguous()
        case.sets.append(s)
    ssm_snapshot, conv_snapshot = ssm_pool.clone(), conv_pool.clone()

    if ours is not None:
        meta = ours.Meta.build(seqlens, dev)
        ws = {}
        if ours.Workspace is not None and ctx.cuda:
            ws["workspace"] = ours.Workspace.empty(T, meta.num_chunk_rows, d.HV, d.K, d.V, ACT, dev)

        def conv(s):
            return ours.conv(s.x, p.conv_w, conv_pool, meta, s.src, s.dst, activation="silu", out=s.y)

        def chunk(s):
            q, k, v = split_qkv(s.y, d)
            return ours.chunk(q, k, v, s.a, s.b, p.A_log, p.dt_bias, ssm_pool, meta, s.src, s.dst, out=s.o, **ws)

        def ours_fn(s):
            conv(s)
            return chunk(s)

        case.impls.append(Impl("ours", ours_fn, {"conv_prefill": conv, "chunk": chunk}, True))

    if fla is not None:
        cu, ci = fla.varlen(seqlens, dev)

        def fla_core(s, conv_init, ssm_init):
            y, conv_fin = fla.conv(s.x[None], p.conv_w, conv_init, cu, ci)
            q, k, v = split_qkv(y, d)
            o, ssm_fin = fla.chunk(q, k, v, s.a[None], s.b[None], p.A_log, p.dt_bias, ssm_init, cu, ci)
            return o, ssm_fin, conv_fin

        def fla_gs(s):
            o, ssm_fin, conv_fin = fla_core(s, fla_conv.index_select(0, s.src_l), fla_ssm.index_select(0, s.src_l))
            fla_ssm.index_copy_(0, s.dst_l, ssm_fin)
            fla_conv.index_copy_(0, s.dst_l, conv_fin)
            return o

        def fla_conv_only(s):
            return fla.conv(s.x[None], p.conv_w, s.conv_init, cu, ci)

        def fla_chunk_only(s):
            if not hasattr(s, "fla_y"):
                s.fla_y = fla_conv_only(s)[0]
            q, k, v = split_qkv(s.fla_y, d)
            return fla.chunk(q, k, v, s.a[None], s.b[None], p.A_log, p.dt_bias, s.ssm_init, cu, ci)

        case.impls.append(Impl("fla", lambda s: fla_core(s, s.conv_init, s.ssm_init),
                               {"causal_conv1d": fla_conv_only, "chunk_gated_delta_rule": fla_chunk_only}, False,
                               baseline=True))
        case.impls.append(Impl("fla+gather/scatter", fla_gs, {}, False))

    def check() -> tuple[str, dict[str, float]]:
        s = case.sets[0]
        ours_fn(s)
        got = {"o": s.o, "state": ssm_pool[s.dst_l], "conv_state": conv_pool[s.dst_l]}
        if fla is not None:
            o, st, cst = fla_core(s, s.conv_init, s.ssm_init)
            ref = {"o": o[0], "state": st, "conv_state": cst[:, :, 1:].transpose(1, 2)}
            name = "fla"
        else:
            from gdnserve.ops.gdn.naive import naive_prefill_pool
            q, k, v = split_qkv(s.y, d)
            o, pool = naive_prefill_pool(q, k, v, s.a, s.b, p.A_log, p.dt_bias, ssm_snapshot, seqlens,
                                         s.src.tolist(), s.dst.tolist())
            ref = {"o": o, "state": pool[s.dst_l.cpu()], "y": _conv_ref(s.x, p.conv_w, conv_snapshot[s.src_l], seqlens),
                   "conv_state": torch.cat([conv_snapshot[s.src_l], s.x.view(N, L, d.D)], 1)[:, -(d.W - 1):]}
            got["y"] = s.y
            name = "naive_f64"
        return name, {key: rel_rms(got[key], ref[key]) for key in ref}

    case.check = check if ours is not None and (fla is not None or ctx.naive_ok(case.params["T"])) else None
    return case


TILE_SWEEP_B = (256,)     # batch sizes whose decode/verify rows also time launch-config variants
DECODE_TILES = ((8, 1), (16, 1), (32, 4), (64, 4))   # (BV, num_warps); (16, 2) is "ours" at B = 256
# token-by-token replay tiles: fla's recurrent kernel runs [K, 8] tiles on one warp
REPLAY_TILES = ((8, 1), (32, 1), (16, 2), (32, 4))   # (16, 1) is "ours" at B = 256
CHUNK_VARIANTS = (((16, 2), "tf32x3"), ((16, 4), "tf32x3"), ((32, 4), "tf32x3"))   # the chunked kernel, opt-in


def _variant(ours: SimpleNamespace, name: str, tile, prec, chunked, bind: Callable[[Any], dict], **kw) -> Impl:
    """A launch-config variant of a recurrent call (the private planner's overrides), prepared per input set."""
    def fn(s):
        if name not in s.prep:
            s.prep[name] = ours.prepared_plan(*bind(s)["args"], tile=tile, prec=prec, chunked=chunked, **kw)
        s.prep[name]()
        return s.o
    return Impl(name, fn, {}, True)


def build_recurrent(ctx: Ctx, B: int, L: int) -> Case:
    """Decode (L = 1) or verify (L > 1) over B requests in distinct random pool slots."""
    d, dev, ours, fla = ctx.plan.dims, ctx.device, ctx.ours, ctx.fla
    verify = L > 1
    nbytes, flops = recurrent_cost(d, B, L)
    case = Case("verify" if verify else "decode", f"B={B} L={L}" if verify else f"B={B}", {"B": B, "L": L},
                nbytes, flops, [])
    n_sets = ctx.n_sets(nbytes)
    S = max(2 * B * n_sets, 8)
    perm = torch.randperm(S, device=dev).to(torch.int32)
    p = _layer_params(d, dev)
    pool = _randn((S, d.HV, d.V, d.K), STATE, dev, 0.05)
    fla_pool = pool.clone()
    snapshot = pool.clone()
    ar = lambda lo, n: torch.arange(lo, lo + n, device=dev, dtype=torch.int32)  # noqa: E731
    for i in range(n_sets):
        slots = perm[i * B:(i + 1) * B]
        y = _randn((B * L, d.D), ACT, dev)
        q, k, v = split_qkv(y, d)
        s = SimpleNamespace(slots=slots, slots_l=slots.long(), y=y, q=q, k=k, v=v, a=_randn((B * L, d.HV), ACT, dev),
                            b=_randn((B * L, d.HV), ACT, dev), o=torch.empty(B * L, d.HV, d.V, device=dev, dtype=ACT),
                            rows=ar(i * B, B), pin=ar(2 * i * B, B), pout=ar((2 * i + 1) * B, B),
                            acc=torch.randint(1, L + 1, (B,), device=dev, dtype=torch.int32),
                            npend=torch.randint(1, L + 1, (B,), device=dev, dtype=torch.int32))
        s.prep = {}   # prepared launchers of this input set, built on first use
        s.fla_in = tuple(t.reshape(B, L, *t.shape[1:]).contiguous() for t in (s.q, s.k, s.v, s.a, s.b))
        s.init = fla_pool[s.slots_l].clone()
        case.sets.append(s)

    if ours is not None and not verify:
        def decode(s):
            return ours.decode(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, out=s.o)

        def prepared_decode(s):   # built once per input set (the step shape), then one launch per call
            if "decode" not in s.prep:
                s.prep["decode"] = ours.prepare_decode(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots,
                                                       out=s.o)
            return s.prep["decode"]()
        case.impls.append(Impl("ours", decode, {"gdn_decode": decode}, True))
        case.impls.append(Impl("ours prepared", prepared_decode, {"PreparedRecurrent (decode)": prepared_decode},
                               True))
        if ctx.cuda and B in TILE_SWEEP_B:
            for tile in DECODE_TILES:
                case.impls.append(_variant(ours, f"ours tile {tile}", tile, None, None, lambda s: dict(
                    args=(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, 1, "final", None, None, None,
                          None, None, None, s.o))))
            case.impls.append(_variant(ours, "ours evict_first", None, None, None, lambda s: dict(
                args=(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, 1, "final", None, None, None,
                      None, None, None, s.o)), evict="evict_first"))
    if ours is not None and verify:
        scratch = torch.empty(B * n_sets, L, d.HV, d.V, d.K, device=dev, dtype=STATE)
        pending = ours.Pending.empty(2 * B * n_sets, L, d.H, d.HV, d.K, d.V, ACT, dev)
        zeros = torch.zeros(B, device=dev, dtype=torch.int32)
        full = torch.full((B,), L, device=dev, dtype=torch.int32)

        def v_int(s):
            return ours.verify(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, tokens_per_req=L,
                               mode="intermediate", scratch=scratch, scratch_rows=s.rows, out=s.o)

        def commit(s, acc=None):
            return ours.commit(pool, scratch, s.rows, s.slots, s.acc if acc is None else acc)

        def v_rep(s, npend=None, pin=None, pout=None):
            return ours.verify(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, tokens_per_req=L,
                               mode="replay", pending=pending, pending_in_rows=s.pin if pin is None else pin,
                               num_pending=s.npend if npend is None else npend,
                               pending_out_rows=s.pout if pout is None else pout, out=s.o)

        def v_int_commit(s):
            o = v_int(s)
            commit(s)
            return o

        def prepared_rep(s):
            if "replay" not in s.prep:
                s.prep["replay"] = ours.prepare_verify(
                    s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, tokens_per_req=L, mode="replay",
                    pending=pending, pending_in_rows=s.pin, num_pending=s.npend, pending_out_rows=s.pout, out=s.o)
            return s.prep["replay"]()

        def rep_args(s):
            return dict(args=(s.q, s.k, s.v, s.a, s.b, p.A_log, p.dt_bias, pool, s.slots, L, "after_pending", None,
                              None, pending, s.pin, s.npend, s.pout, s.o))

        case.impls.append(Impl("ours intermediate+commit", v_int_commit,
                               {"gdn_verify(intermediate)": v_int, "gdn_commit_intermediate": commit}, True))
        case.impls.append(Impl("ours replay", v_rep, {"gdn_verify(replay)": v_rep}, True))
        case.impls.append(Impl("ours replay prepared", prepared_rep, {"PreparedRecurrent (replay)": prepared_rep},
                               True))
        if ctx.cuda:   # the chunked kernel is opt-in (recurrent_triton.CHUNKED_DEFAULT): rows below time it
            case.impls.append(_variant(ours, "ours replay chunked", None, None, True, rep_args))
        if ctx.cuda and B in TILE_SWEEP_B:
            for tile in REPLAY_TILES:
                case.impls.append(_variant(ours, f"ours replay tile {tile}", tile, None, False, rep_args))
            for tile, prec in CHUNK_VARIANTS:
                case.impls.append(_variant(ours, f"ours replay chunk {tile} {prec}", tile, prec, True, rep_args))

    if fla is not None:
        def fla_plain(s, init=None):
            return fla.recurrent(*s.fla_in, p.A_log, p.dt_bias, s.init if init is None else init)

        def fla_gs(s):
            o, st = fla.recurrent(*s.fla_in, p.A_log, p.dt_bias, fla_pool.index_select(0, s.slots_l))
            fla_pool.index_copy_(0, s.slots_l, st)
            return o

        tag = f"fla T={L}" if verify else "fla"
        case.impls.append(Impl(tag, fla_plain, {"fused_recurrent_gated_delta_rule": fla_plain}, False, baseline=True))
        case.impls.append(Impl(f"{tag}+gather/scatter", fla_gs, {}, False))

    def reference(s) -> tuple[str, torch.Tensor, torch.Tensor]:
        if fla is not None:
            o, st = fla.recurrent(*s.fla_in, p.A_log, p.dt_bias, s.init)
            return "fla", o.reshape(B * L, d.HV, d.V), st
        from gdnserve.ops.gdn.naive import naive_recurrent
        outs = [naive_recurrent(s.q[j * L:(j + 1) * L], s.k[j * L:(j + 1) * L], s.v[j * L:(j + 1) * L],
                                s.a[j * L:(j + 1) * L], s.b[j * L:(j + 1) * L], p.A_log, p.dt_bias,
                                snapshot[s.slots_l[j]]) for j in range(B)]
        return "naive_f64", torch.cat([o for o, _ in outs]), torch.stack([st for _, st in outs])

    def prepare() -> None:  # fill every set's pending rows (num_pending = 0): its timed calls replay them
        for t in case.sets:
            v_rep(t, npend=zeros, pin=t.pout, pout=t.pin)

    def check() -> tuple[str, dict[str, float]]:
        s = case.sets[0]
        name, o_ref, st_ref = reference(s)
        if not verify:
            decode(s)
            return name, {"o": rel_rms(s.o, o_ref), "state": rel_rms(pool[s.slots_l], st_ref)}
        r = {"o(replay)": rel_rms(v_rep(s, npend=zeros, pin=s.pout, pout=s.pin), o_ref)}
        pool.index_copy_(0, s.slots_l, snapshot[s.slots_l])
        r["o(intermediate)"] = rel_rms(v_int(s), o_ref)
        commit(s, full)
        r["state(commit L)"] = rel_rms(pool[s.slots_l], st_ref)
        return name, r

    if ours is not None and verify:
        case.prepare = prepare
    case.check = check if ours is not None and (fla is not None or ctx.naive_ok(B * L)) else None
    return case


# ------------------------------------------------------------------------------------------ running

def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:500]


def run_case(ctx: Ctx, case: Case, ceilings: dict[str, Any], errors: list[dict[str, str]]) -> list[dict[str, Any]]:
    plan, where = ctx.plan, f"{case.kind} {case.label}"
    sanity: dict[str, Any] = {}
    if case.prepare is not None:
        try:
            case.prepare()
        except Exception as e:  # noqa: BLE001
            errors.append({"where": f"{where} prepare", "error": _err(e)})
            log(f"{where}: prepare FAILED: {_err(e)}")
    if case.check is not None:
        log(f"{where}: checking ours against the reference")
        try:
            ref_name, rel = case.check()
            sanity = {"ref": ref_name, "rel_rms": rel, "rel_rms_max": max(rel.values()) if rel else None}
        except Exception as e:  # noqa: BLE001 — one broken op must not end the run
            errors.append({"where": f"{where} check", "error": _err(e)})
            log(f"{where}: check FAILED: {_err(e)}")
            traceback.print_exc(file=sys.stderr)
    rows = []
    for impl in case.impls:
        log(f"{where}: timing {impl.name} ({len(case.sets)} input set(s))")
        row: dict[str, Any] = {"case": case.kind, "shape": case.label, "impl": impl.name, "ours": impl.ours,
                               "params": case.params, "bytes": case.nbytes, "flops": case.flops}
        try:
            r = time_call(impl.fn, iters=plan.iters, warmup=plan.warmup, rotate=case.sets,
                          host_iters=plan.host_iters, device=ctx.device)
            row.update(r)
            row["host_parts_us"] = {name: host_time(fn, iters=plan.host_iters, rotate=case.sets, device=ctx.device)
                                    for name, fn in impl.parts.items()}
            gpu = r["gpu_us"]["p50"] * 1e-6
            row["TBps"] = case.nbytes / gpu / 1e12
            row["TFLOPs"] = case.flops / gpu / 1e12
            row["pct_copy"] = 100 * row["TBps"] / ceilings["copy_TBps"]
            row["pct_bf16"] = 100 * row["TFLOPs"] / ceilings["bf16_matmul_TFLOPs"]
            row["floor_us"] = 1e6 * max(case.nbytes / (ceilings["copy_TBps"] * 1e12),
                                        case.flops / (ceilings["bf16_matmul_TFLOPs"] * 1e12))
            row["x_floor"] = r["gpu_us"]["p50"] / row["floor_us"]
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
            errors.append({"where": f"{where} {impl.name}", "error": row["error"]})
            log(f"{where}: {impl.name} FAILED: {row['error']}")
            traceback.print_exc(file=sys.stderr)
        if impl.ours and sanity:
            row.update(sanity)
        rows.append(row)
    base = {impl.name for impl in case.impls if impl.baseline}
    fla_row = next((r for r in rows if r["impl"] in base and "gpu_us" in r), None)
    gs_row = next((r for r in rows if not r["ours"] and "gather" in r["impl"] and "gpu_us" in r), None)
    for r in rows:
        if "gpu_us" not in r:
            continue
        if fla_row is not None:
            r["vs_fla_gpu"] = r["gpu_us"]["p50"] / fla_row["gpu_us"]["p50"]
            r["vs_fla_call"] = r["call_us"]["p50"] / fla_row["call_us"]["p50"]
        if r["ours"] and gs_row is not None:
            r["vs_fla_gs_gpu"] = r["gpu_us"]["p50"] / gs_row["gpu_us"]["p50"]
    return rows


TARGETS = (  # (name, case, shape, impl, metric, goal, unit)
    ("prefill 1x32768: ours GPU time <= 0.33x fla", "prefill", "1x32768", "ours", "vs_fla_gpu", 0.33, "x"),
    ("prefill 64x256: ours GPU time <= 0.5x fla", "prefill", "64x256", "ours", "vs_fla_gpu", 0.5, "x"),
    ("decode B=256: ours GPU time <= 265 µs", "decode", "B=256", "ours", "gpu", 265.0, "µs"),
    ("decode B=1: ours prepared call time <= 20 µs", "decode", "B=1", "ours prepared", "call", 20.0, "µs"),
    ("verify B=256 L=4 replay: ours GPU time <= 300 µs", "verify", "B=256 L=4", "ours replay", "gpu", 300.0, "µs"),
    ("host cost per launcher call <= 25 µs (worst of our ops)", None, None, None, "host", 25.0, "µs"),
    ("host cost per prepared launcher call <= 25 µs (worst)", None, None, None, "host_prepared", 25.0, "µs"),
)


def evaluate_targets(rows: list[dict[str, Any]], full_shape: bool) -> list[dict[str, Any]]:
    out = []
    for name, case, shape, impl, metric, goal, unit in TARGETS:
        t: dict[str, Any] = {"target": name, "goal": goal, "unit": unit, "value": None, "result": "not measured"}
        if not full_shape:
            t["result"] = "n/a (targets are for the Qwen3.5 shape on the H200)"
            out.append(t)
            continue
        if metric in ("host", "host_prepared"):
            parts = [(v, f"{r['case']} {r['shape']} {op}") for r in rows if r["ours"]
                     for op, v in r.get("host_parts_us", {}).items() if ("Prepared" in op) == (metric != "host")]
            if parts:
                t["value"], t["where"] = max(parts)
        else:
            r = next((r for r in rows if (r["case"], r["shape"], r["impl"]) == (case, shape, impl)), None)
            if r is not None and "gpu_us" in r:
                t["value"] = {"gpu": r["gpu_us"]["p50"], "call": r["call_us"]["p50"]}.get(metric, r.get(metric))
                if metric == "vs_fla_gpu" and r.get("vs_fla_gs_gpu") is not None:
                    t["where"] = f"vs fla+gather/scatter: {r['vs_fla_gs_gpu']:.2f}x"
        if t["value"] is not None:
            v = t["value"]
            t["result"] = "pass" if v <= goal else "miss"
            t["gap"] = v - goal
            t["gap_pct"] = 100 * (v - goal) / goal
        out.append(t)
    return out


# ----------------------------------------------------------------------------------------- reports

def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()})"


def device_slug(dev: torch.device) -> str:
    if dev.type != "cuda":
        return "cpu"
    s = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(dev).lower().replace("nvidia", "")).strip("-")
    return s or "cuda"


def _git() -> dict[str, Any] | None:
    """The code's commit. ``GDNSERVE_CODE_COMMIT`` wins: the device tool ships the working tree over a checkout of
    the session's first commit, so git there names that commit, "dirty" (device.sh documents the variable)."""
    given = os.environ.get("GDNSERVE_CODE_COMMIT", "").strip()
    if given:
        return {"commit": given, "dirty": False}
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())} if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _pct(p: dict[str, float]) -> str:
    return f"{p['p50']:.1f} [{p['p10']:.1f}–{p['p90']:.1f}]"


def _f(v: Any, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    L = ["## Targets", "", "| target | measured | result | gap |", "| --- | --- | --- | --- |"]
    for t in targets:
        val = "—" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        gap = "—" if t.get("gap") is None else f"{t['gap']:+.2f} {t['unit']} ({t['gap_pct']:+.0f} %)"
        extra = f" ({t['where']})" if t.get("where") else ""
        L.append(f"| {t['target']} | {val}{extra} | {t['result']} | {gap} |")
    return L


def to_markdown(res: dict[str, Any]) -> str:
    c, d = res["ceilings"], res["dims"]
    L = [f"# Op benchmarks — {res['device']}, {res['date']}", "",
         f"torch {res['torch']}, triton {res['triton']}, fla {res['fla'] or '—'}, gdnserve {res['gdnserve']}"
         + (f" (git {res['git']['commit']}{', dirty' if res['git']['dirty'] else ''})" if res.get("git") else "")
         + f"; {'quick' if res['quick'] else 'full'} run.",
         f"Shape H={d['H']} HV={d['HV']} K={d['K']} V={d['V']} W={d['W']} (D={d['D']}), bf16 activations, "
         f"fp32 state pool [S, HV, V, K]; slots random and distinct; seed {res['seed']}.",
         f"Ceilings measured in this run: copy {c['copy_TBps']:.3g} TB/s ({c['copy_bytes'] >> 20} MiB, read+write), "
         f"bf16 matmul {c['bf16_matmul_TFLOPs']:.3g} TFLOP/s and fp32 (TF32 off) {c['fp32_matmul_TFLOPs']:.3g} "
         f"TFLOP/s ({c['matmul_n']}³).", ""]
    if res.get("fla_note"):
        L += [f"fla: {res['fla_note']}.", ""]
    L += targets_table(res["targets"])
    if res["device_slug"] == "cpu":
        how = ("µs, median [P10–P90] of perf_counter wall time around one call (the GPU column repeats it). CPU "
               "run: tiny shapes, PyTorch path, a smoke test of the ops and this harness, not a performance figure.")
    else:
        how = ("µs, median [P10–P90]. call: CUDA events around the Python call, GPU idle before it (host overhead "
               "included). GPU: per call in a replayed CUDA graph of back-to-back calls (`batched_events` if not "
               "capturable).")
    L += ["", "## Timings", "",
          how + " ÷fla: this row over the `fla` row of the case (medians). TB/s and TFLOP/s: essential bytes and "
          "FLOPs (benchmarks/bench_ops.py docstring) over the GPU median, in % of the measured ceilings; ×floor: GPU "
          "median over max(bytes / copy rate, FLOPs / bf16 rate). host: mean perf_counter of one whole row call, GPU "
          "idle at its start. rel-RMS: the largest over the tensors compared, ours against the reference named.", "",
          "| case | impl | call µs | GPU µs | ÷fla GPU | ÷fla call | TB/s (% copy) | TFLOP/s (% bf16) | ×floor "
          "| host µs | rel-RMS (ref) |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "error" in r:
            L.append(f"| {r['case']} {r['shape']} | {r['impl']} | error: {r['error'][:120]} |" + " |" * 8)
            continue
        gm = "" if r["gpu_method"] in ("cuda_graph", "cpu_wall") else f" ({r['gpu_method']})"
        rel = "—" if r.get("rel_rms_max") is None else f"{r['rel_rms_max']:.1e} ({r['ref']})"
        L.append(f"| {r['case']} {r['shape']} | {r['impl']} | {_pct(r['call_us'])} | {_pct(r['gpu_us'])}{gm} | "
                 f"{_f(r.get('vs_fla_gpu'), '.2f')} | {_f(r.get('vs_fla_call'), '.2f')} | "
                 f"{r['TBps']:.3g} ({r['pct_copy']:.0f} %) | {r['TFLOPs']:.3g} ({r['pct_bf16']:.1f} %) | "
                 f"{r['x_floor']:.2f} | {r['host_us']:.1f} | {rel} |")
    L += ["", "## Host cost of one launcher call", "",
          "perf_counter around one public op call, no sync inside, GPU idle at its start; mean µs.", "",
          "| case | impl | op | host µs |", "| --- | --- | --- | --- |"]
    for r in res["rows"]:
        for op, v in r.get("host_parts_us", {}).items():
            L.append(f"| {r['case']} {r['shape']} | {r['impl']} | {op} | {v:.1f} |")
    sanity = [r for r in res["rows"] if r.get("rel_rms")]
    if sanity:
        L += ["", "## Sanity: rel-RMS of ours against the reference", "", "| case | impl | ref | rel-RMS by tensor |",
              "| --- | --- | --- | --- |"]
        for r in sanity:
            L.append(f"| {r['case']} {r['shape']} | {r['impl']} | {r['ref']} | "
                     + ", ".join(f"{k} {v:.1e}" for k, v in r["rel_rms"].items()) + " |")
    if res["errors"]:
        L += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in res["errors"]]
    if res.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(L) + "\n"


def _versions() -> dict[str, Any]:
    import gdnserve
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    return {"torch": torch.__version__, "triton": tv, "gdnserve": gdnserve.__version__,
            "python": platform.python_version()}


def load_fla(use_fla: bool, cuda: bool, notes: list[str], cpu_note: str = "", missing: str = "no fla rows"):
    """The fla peer, or None with the reason appended to ``notes`` (also used by bench_grouped_prefill)."""
    if not use_fla:
        return None
    if not cuda:
        notes.append("fla not run on CPU (its kernels need CUDA)" + cpu_note)
        return None
    try:
        return Fla()
    except Exception as e:  # noqa: BLE001
        notes.append(f"fla not importable ({_err(e)}): {missing}. Install fla-core==0.6.0 "
                     f"(pip install -e '.[bench]') or pass --no-fla")
        log(notes[-1])
        return None


def parse_only(specs: list[str] | None) -> dict[str, set[int] | None] | None:
    """--only KIND[:SIZES] options -> {kind: sizes or None (all)}; None = every case."""
    if not specs:
        return None
    out: dict[str, set[int] | None] = {}
    for spec in specs:
        kind, _, sizes = spec.partition(":")
        if kind not in ("prefill", "decode", "verify"):
            raise ValueError(f"--only {spec}: kind must be prefill, decode or verify")
        try:
            out[kind] = {int(x) for x in sizes.split(",")} if sizes else None
        except ValueError:
            raise ValueError(f"--only {spec}: sizes must be comma-separated integers") from None
    return out


def restrict(plan: Plan, only: dict[str, set[int] | None] | None) -> Plan:
    if only is None:
        return plan
    keep = lambda kind, xs, size: tuple(x for x in xs if kind in only and (only[kind] is None  # noqa: E731
                                                                        or size(x) in only[kind]))
    return replace(plan, prefill=keep("prefill", plan.prefill, lambda x: x[0]),
                   decode=keep("decode", plan.decode, int), verify=keep("verify", plan.verify, int))


def run(device: torch.device, quick: bool, out_dir: Path, use_fla: bool,
        only: dict[str, set[int] | None] | None = None) -> dict[str, Any]:
    """Run every case (or those ``only`` names), write the JSON and markdown (rewritten after every case, so a
    run cut short keeps what it measured), return the result dict (with ``paths``)."""
    cuda = device.type == "cuda"
    plan = restrict(make_plan(cuda, quick), only)
    notes: list[str] = []
    errors: list[dict[str, str]] = []
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    if cuda:
        torch.cuda.set_device(device.index if device.index is not None else 0)
    try:
        ours = load_ours()
    except Exception as e:  # noqa: BLE001
        ours = None
        errors.append({"where": "import gdnserve ops", "error": _err(e)})
        log(f"gdnserve ops not importable: {_err(e)} — timing fla only")
    fla = load_fla(use_fla, cuda, notes, cpu_note="; rel-RMS is against the float64 reference",
                   missing="no comparison rows")
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) if cuda else 0
    ctx = Ctx(plan, device, ours, fla, l2)
    git = _git()

    def assemble() -> dict[str, Any]:
        return {
            "schema": 1, "device": device_name(device), "device_slug": device_slug(device),
            "date": _dt.date.today().isoformat(), **_versions(), "fla": fla.version if fla else None,
            "fla_note": fla.note if fla else None, "git": git, "seed": seed, "quick": quick,
            "only": None if only is None else {k: None if v is None else sorted(v) for k, v in only.items()},
            "dims": {**plan.dims.__dict__, "D": plan.dims.D}, "iters": plan.iters, "host_iters": plan.host_iters,
            "ceilings": ceilings, "rows": rows, "errors": errors, "notes": notes,
            "targets": evaluate_targets(rows, cuda and plan.dims == QWEN35_GDN),
        }

    log(f"{device_name(device)}: measuring ceilings")
    with torch.inference_mode():
        ceilings = measure_ceilings(device, quick=quick)
        log(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 {ceilings['bf16_matmul_TFLOPs']:.1f} TFLOP/s, "
            f"fp32 {ceilings['fp32_matmul_TFLOPs']:.1f} TFLOP/s")
        builders = ([(build_prefill, n, l) for n, l in plan.prefill] + [(build_recurrent, b, 1) for b in plan.decode]
                    + [(build_recurrent, b, VERIFY_L) for b in plan.verify])
        rows: list[dict[str, Any]] = []
        for build, x, y in builders:
            case = None
            try:
                case = build(ctx, x, y)
                if case.impls:
                    rows += run_case(ctx, case, ceilings, errors)
            except Exception as e:  # noqa: BLE001
                errors.append({"where": f"{build.__name__}({x}, {y})", "error": _err(e)})
                log(f"{build.__name__}({x}, {y}) FAILED: {_err(e)}")
                traceback.print_exc(file=sys.stderr)
            del case
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            write_results(assemble(), out_dir, final=False)
    if not any(r["ours"] and "gpu_us" in r for r in rows):
        errors.append({"where": "run", "error": "no row of ours was timed"})
    if fla is not None and not fla.gates_in_kernel:
        notes.append(fla.note)
    notes += [f"{r['case']} {r['shape']} {r['impl']}: not graph-capturable, GPU column is batched events "
              f"({r['graph_error']})" for r in rows if r.get("graph_error")]
    res = write_results(assemble(), out_dir, final=True)
    print(res.pop("_md"))
    if res["rows"]:  # the table is long: repeat the targets last, where a log's tail shows them
        print("\n".join(["# Summary", ""] + targets_table(res["targets"])))
    log(f"wrote {res['paths']['json']} and {res['paths']['md']}" + (f"; {len(errors)} error(s)" if errors else ""))
    return res


def write_results(res: dict[str, Any], out_dir: Path, final: bool) -> dict[str, Any]:
    """The JSON and markdown of ``res`` (``partial`` until the last case has run)."""
    res["partial"] = not final
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"ops_{res['device_slug']}_{res['date']}"
    res["paths"] = {"json": str(stem.with_suffix(".json")), "md": str(stem.with_suffix(".md"))}
    Path(res["paths"]["json"]).write_text(jsonfmt.dumps(res))
    res["_md"] = to_markdown(res)
    Path(res["paths"]["md"]).write_text(res["_md"])
    return res


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    return dev


def run_from_args(args: argparse.Namespace) -> int:
    """Entry used by ``gdnserve bench ops``: 0 if every row ran, 1 if anything failed, 2 on bad options."""
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        print(f"bench ops: {e}", file=sys.stderr)
        return 2
    try:
        only = parse_only(getattr(args, "only", None))
    except ValueError as e:
        print(f"bench ops: {e}", file=sys.stderr)
        return 2
    shapes = getattr(args, "prefill_shapes", None)
    if shapes:
        try:
            prefill = tuple(tuple(int(x) for x in sh.split("x")) for sh in shapes.split(","))
            assert all(len(sh) == 2 and min(sh) > 0 for sh in prefill)
        except (ValueError, AssertionError):
            print(f"bench ops: --prefill-shapes {shapes}: expected NxL[,NxL...]", file=sys.stderr)
            return 2
        global make_plan
        base = make_plan
        make_plan = lambda cuda, quick: replace(base(cuda, quick), prefill=prefill)  # noqa: E731
    res = run(device, quick=args.quick, out_dir=Path(args.out), use_fla=args.fla, only=only)
    return 1 if res["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    from gdnserve.cli import add_bench_ops_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ops", description=__doc__.split("\n")[0])
    add_bench_ops_arguments(parser)
    parser.add_argument("--only", action="append", default=None, metavar="KIND[:SIZES]",
                        help="run only these cases, e.g. --only decode:1,256 --only verify:256 (kinds prefill, "
                             "decode, verify; sizes: N for prefill N x L, B otherwise; repeatable)")
    parser.add_argument("--prefill-shapes", default=None, metavar="NxL[,NxL...]",
                        help="the prefill cases instead of the plan's, e.g. 1x4096,8x1024 (the model profile's)")
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
