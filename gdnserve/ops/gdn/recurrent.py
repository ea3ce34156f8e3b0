"""Recurrent gated delta rule over a slot-indexed SSM pool: decode, speculative verify (intermediate
states into a scratch ring, or replay of pending raw inputs), commit and flush (gdn_kernels.md
§1.2 math, §1.3 layout, §3.4–3.5 decode/verify).

Per value head j (key head i = j // r), per token, with the pool tile St = S^T [V, K] in fp32:
    St <- exp(g) St;  u = beta (v - St k̂);  St <- St + u k̂^T;  o = St q̂
q̂ = l2norm(q) * scale, k̂ = l2norm(k), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).

Speculative decoding, two schemes (the caller builds every index vector once per step):
- intermediate: ``gdn_verify(mode="intermediate")`` writes the state after every token to
  ``scratch[scratch_rows[n], t]``; ``gdn_commit_intermediate`` copies the accepted one into the slot.
- replay: ``gdn_verify(mode="replay")`` first re-applies the accepted tokens of the previous step
  from ``pending`` (their raw inputs) and writes that committed state to the slot, then runs the new
  tokens without writing the slot and stores their raw inputs as pending: one state read and one
  state write per step. ``gdn_flush_pending`` (or a decode with ``pending``) ends the chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, STATE_DTYPES, check_contiguous, check_index, check_tensor
from gdnserve.ops.gdn.gates import gates, l2norm
from gdnserve.ops.gdn.recurrent_triton import MAX_GRID_Z, gdn_commit_fwd, gdn_recurrent_fwd, recurrent_plan
from gdnserve.ops.launch import Prepared

WriteState = Literal["final", "after_pending", "none"]
_WRITE_STATES = ("final", "after_pending", "none")
F32 = torch.float32
_I32 = (torch.int32,)


@dataclass(slots=True)
class GDNPending:
    """Raw inputs of verified-but-uncommitted tokens, one row per request (callers ping-pong rows
    between steps so the rows read and written by one call never alias). Input dtypes, contiguous.
    k: [P, Lmax, H, K]; v: [P, Lmax, HV, V]; a, b: [P, Lmax, HV]."""
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    @staticmethod
    def empty(P: int, Lmax: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype,
              device: torch.device | str, gate_dtype: torch.dtype | None = None) -> "GDNPending":
        gd = dtype if gate_dtype is None else gate_dtype
        return GDNPending(k=torch.empty(P, Lmax, H, K, dtype=dtype, device=device),
                          v=torch.empty(P, Lmax, HV, V, dtype=dtype, device=device),
                          a=torch.empty(P, Lmax, HV, dtype=gd, device=device),
                          b=torch.empty(P, Lmax, HV, dtype=gd, device=device))


def _ok(t, shape: tuple, dtypes, dev) -> bool:
    """The happy path of check_tensor in a fraction of its host time (the op is called per layer)."""
    return (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype in dtypes and t.device == dev
            and (t.stride(-1) == 1 or shape[-1] <= 1))


def _need(name, t, shape: tuple, dtypes, dev) -> None:
    if not _ok(t, shape, dtypes, dev):
        check_tensor(name, t, shape, dtypes, dev)  # raises naming the tensor


def _need_index(name, t, n: int, dev) -> None:
    if not _ok(t, (n,), _I32, dev):
        check_index(name, t, n, dev)


def _need_contiguous(name, t) -> None:
    if not t.is_contiguous():
        check_contiguous(name, t)


def _check(q, k, v, a, b, A_log, dt_bias, pool, slots, L, write_state, scratch, scratch_rows,
           pending, pin, npend, pout, out) -> None:
    if not (isinstance(pool, torch.Tensor) and pool.dim() == 4 and pool.dtype in STATE_DTYPES):
        check_tensor("ssm_pool", pool, [None] * 4, STATE_DTYPES)
    _need_contiguous("ssm_pool", pool)
    _, HV, V, K = pool.shape
    dev = pool.device
    if K > 256 or V > 256:
        raise ValueError(f"ssm_pool: K and V must be <= 256 (state tile held in registers), got K={K}, V={V}")
    if not (isinstance(slots, torch.Tensor) and slots.dim() == 1 and _ok(slots, (slots.shape[0],), _I32, dev)):
        check_index("slots", slots, None, dev)
    B = slots.shape[0]
    if B > MAX_GRID_Z:
        raise ValueError(f"slots: at most {MAX_GRID_Z} requests per call, got {B}")
    if not isinstance(L, int) or L < 0:
        raise ValueError(f"tokens_per_req: expected an int >= 0, got {L!r}")
    if write_state not in _WRITE_STATES:
        raise ValueError(f"write_state: expected one of {_WRITE_STATES}, got {write_state!r}")
    T = B * L
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and _ok(q, (T, q.shape[1], K), ACT_DTYPES, dev)):
        check_tensor("q", q, [T, None, K], ACT_DTYPES, dev)
    H = q.shape[1]
    if H == 0 or HV % H:
        raise ValueError(f"q: key heads H={H} must divide the value heads HV={HV} of ssm_pool")
    _need("k", k, (T, H, K), (q.dtype,), dev)
    _need("v", v, (T, HV, V), ACT_DTYPES, dev)
    _need("a", a, (T, HV), ACT_DTYPES, dev)
    _need("b", b, (T, HV), (a.dtype,), dev)
    _need("A_log", A_log, (HV,), (F32,), dev)
    _need("dt_bias", dt_bias, (HV,), (F32, torch.bfloat16), dev)
    if out is not None:
        _need("out", out, (T, HV, V), (v.dtype,), dev)
    if (scratch is None) != (scratch_rows is None):
        raise ValueError("scratch/scratch_rows: give both or neither")
    if scratch is not None:
        check_tensor("scratch", scratch, [None, None, HV, V, K], STATE_DTYPES, dev)
        _need_contiguous("scratch", scratch)
        if scratch.shape[1] < L:
            raise ValueError(f"scratch: needs >= {L} token rows (dim 1), got {scratch.shape[1]}")
        _need_index("scratch_rows", scratch_rows, B, dev)
    if (pin is None) != (npend is None):
        raise ValueError("pending_in_rows/num_pending: give both or neither")
    if (pin is not None or pout is not None) and pending is None:
        raise ValueError("pending: required with pending_in_rows / pending_out_rows")
    if pending is not None:
        if not isinstance(pending.k, torch.Tensor) or pending.k.dim() != 4:
            raise ValueError("pending.k: expected a [P, Lmax, H, K] tensor")
        P, Lp = pending.k.shape[:2]
        for name, t, shape, dt in (("pending.k", pending.k, (P, Lp, H, K), k.dtype),
                                   ("pending.v", pending.v, (P, Lp, HV, V), v.dtype),
                                   ("pending.a", pending.a, (P, Lp, HV), a.dtype),
                                   ("pending.b", pending.b, (P, Lp, HV), b.dtype)):
            _need(name, t, shape, (dt,), dev)
            _need_contiguous(name, t)
        if pin is not None:
            _need_index("pending_in_rows", pin, B, dev)
            _need_index("num_pending", npend, B, dev)
        if pout is not None:
            _need_index("pending_out_rows", pout, B, dev)
            if Lp < L:
                raise ValueError(f"pending.k: needs >= {L} token rows (dim 1), got {Lp}")


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor, *,
                  tokens_per_req: int, write_state: WriteState = "final",
                  scratch: torch.Tensor | None = None, scratch_rows: torch.Tensor | None = None,
                  pending: GDNPending | None = None, pending_in_rows: torch.Tensor | None = None,
                  num_pending: torch.Tensor | None = None, pending_out_rows: torch.Tensor | None = None,
                  scale: float | None = None, out: torch.Tensor | None = None,
                  backend: Backend = "auto") -> torch.Tensor:
    """The core recurrent op; B requests of L = tokens_per_req tokens each (request n owns rows
    [n*L, (n+1)*L)). q/k/v/a/b may be strided views (last dim stride 1).

    q, k: [B*L, H, K]; v: [B*L, HV, V]; a, b: [B*L, HV] raw; A_log: [HV] fp32; dt_bias: [HV]
    ssm_pool: [S, HV, V, K] fp32|bf16, updated in place; slots: [B] int32, -1 = padding (zero
    output rows, nothing else read or written)
    scratch: [R, Lmax, HV, V, K] fp32|bf16; scratch_rows: [B] int32 -> scratch[row, t] = state
        after token t (rows < 0 skip)
    pending: GDNPending; pending_in_rows, num_pending: [B] int32 -> first apply num_pending[n]
        pending tokens of row pending_in_rows[n] (< 0: none), outputs discarded
    pending_out_rows: [B] int32 -> pending row gets the raw k, v, a, b of the L tokens (< 0: skip)
    write_state: "final" (slot = state after all tokens), "after_pending" (slot = state after the
        pending tokens), "none"
    Returns o: [B*L, HV, V] in v.dtype (written into `out` if given)."""
    _check(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state, scratch, scratch_rows,
           pending, pending_in_rows, num_pending, pending_out_rows, out)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    impl = gdn_recurrent_fwd if resolve(backend, ssm_pool) == "triton" else gdn_recurrent_torch
    impl(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state, scratch, scratch_rows,
         pending, pending_in_rows, num_pending, pending_out_rows, scale, out)
    return out


_ACTS = (0, 1, 2, 3, 4, 7)   # q, k, v, a, b, out: their positions in both kernels' arguments


class PreparedRecurrent:
    """``gdn_recurrent`` prepared once per step shape (``prepare_recurrent``): validated and planned at
    construction; a call launches the kernel directly (about one Triton launch of host time).

    ``p()`` runs on the bound tensors; ``p(q, k, v, a, b, out)`` on new activations (another layer's, or
    the next step's): they must have the shapes, strides and dtypes of the bound ones (not re-checked;
    alignment is). Returns ``out``."""

    __slots__ = ("_launch", "_args", "out")

    def __init__(self, launch_or_none, args: tuple):
        self._launch, self._args, self.out = launch_or_none, args, args[18]

    def __call__(self, *acts: torch.Tensor) -> torch.Tensor:
        if self._launch is not None:
            self._launch(*acts)
            return acts[5] if acts else self.out
        args = list(self._args)
        if acts:
            args[0:5], args[18] = acts[:5], acts[5]
        gdn_recurrent_torch(*args)
        return args[18]


def prepare_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, *, tokens_per_req: int,
                      write_state: WriteState = "final", scratch=None, scratch_rows=None, pending=None,
                      pending_in_rows=None, num_pending=None, pending_out_rows=None, scale=None, out=None,
                      backend: Backend = "auto") -> PreparedRecurrent:
    """Arguments as ``gdn_recurrent``, checked here once; returns the prepared call (``PreparedRecurrent``).
    Everything but the activations (pool, gates, index vectors, scratch, pending) stays bound: build one
    per layer and step shape from the step's persistent buffers."""
    _check(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state, scratch, scratch_rows,
           pending, pending_in_rows, num_pending, pending_out_rows, out)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    args = (q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state, scratch, scratch_rows,
            pending, pending_in_rows, num_pending, pending_out_rows, scale, out)
    if resolve(backend, ssm_pool) != "triton":
        return PreparedRecurrent(None, args)
    fn, grid, targs, nw, key = recurrent_plan(*args)
    return PreparedRecurrent(Prepared(fn, grid, targs, nw, key=key, per_call=_ACTS), args)


def prepare_decode(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, *, pending=None, pending_in_rows=None,
                   num_pending=None, scale=None, out=None, backend: Backend = "auto") -> PreparedRecurrent:
    """``gdn_decode`` prepared (see ``prepare_recurrent``)."""
    return prepare_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req=1, write_state="final",
                             pending=pending, pending_in_rows=pending_in_rows, num_pending=num_pending,
                             scale=scale, out=out, backend=backend)


def prepare_verify(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, *, tokens_per_req: int,
                   mode: Literal["intermediate", "replay"], scratch=None, scratch_rows=None, pending=None,
                   pending_in_rows=None, num_pending=None, pending_out_rows=None, scale=None, out=None,
                   backend: Backend = "auto") -> PreparedRecurrent:
    """``gdn_verify`` prepared (see ``prepare_recurrent``)."""
    return prepare_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req=tokens_per_req,
                             write_state=_verify_write_state(mode, scratch, pending, pending_out_rows),
                             scratch=scratch, scratch_rows=scratch_rows, pending=pending,
                             pending_in_rows=pending_in_rows, num_pending=num_pending,
                             pending_out_rows=pending_out_rows, scale=scale, out=out, backend=backend)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, *, pending=None, pending_in_rows=None,
               num_pending=None, scale=None, out=None, backend: Backend = "auto") -> torch.Tensor:
    """One token per request, state written back to the slot. q, k: [B, H, K]; v: [B, HV, V];
    a, b: [B, HV]; ssm_pool: [S, HV, V, K]; slots: [B] int32, -1 = skip. Optional pending tokens
    (a replay verify's accepted tokens) are applied first. Returns o: [B, HV, V]."""
    return gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req=1, write_state="final",
                         pending=pending, pending_in_rows=pending_in_rows, num_pending=num_pending,
                         scale=scale, out=out, backend=backend)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, *, tokens_per_req: int,
               mode: Literal["intermediate", "replay"], scratch=None, scratch_rows=None, pending=None,
               pending_in_rows=None, num_pending=None, pending_out_rows=None, scale=None, out=None,
               backend: Backend = "auto") -> torch.Tensor:
    """Verify L = tokens_per_req tokens per request. q, k: [B*L, H, K]; v: [B*L, HV, V]; a, b: [B*L, HV].
    intermediate: slot untouched, state after token t -> scratch[scratch_rows[n], t] (scratch
        [R, Lmax, HV, V, K], scratch_rows [B] int32); commit with gdn_commit_intermediate.
    replay: apply the num_pending[n] accepted pending tokens (row pending_in_rows[n]), write that
        state to the slot, run the L tokens without writing the slot, store their raw inputs in row
        pending_out_rows[n]. Returns o: [B*L, HV, V]."""
    return gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req=tokens_per_req,
                         write_state=_verify_write_state(mode, scratch, pending, pending_out_rows), scratch=scratch, scratch_rows=scratch_rows, pending=pending,
                         pending_in_rows=pending_in_rows, num_pending=num_pending,
                         pending_out_rows=pending_out_rows, scale=scale, out=out, backend=backend)


def _verify_write_state(mode, scratch, pending, pending_out_rows) -> WriteState:
    if mode == "intermediate":
        if scratch is None:
            raise ValueError("scratch: required by mode='intermediate'")
        return "none"
    if mode == "replay":
        if pending is None or pending_out_rows is None:
            raise ValueError("pending/pending_out_rows: required by mode='replay'")
        return "after_pending"
    raise ValueError(f"mode: expected 'intermediate' or 'replay', got {mode!r}")


def gdn_commit_intermediate(ssm_pool: torch.Tensor, scratch: torch.Tensor, scratch_rows: torch.Tensor,
                            slots: torch.Tensor, num_accepted: torch.Tensor, *, backend: Backend = "auto") -> None:
    """ssm_pool[slots[n]] = scratch[scratch_rows[n], num_accepted[n] - 1] where slots[n] >= 0 and
    num_accepted[n] >= 1 (0 leaves the slot untouched). ssm_pool: [S, HV, V, K]; scratch:
    [R, Lmax, HV, V, K]; scratch_rows, slots, num_accepted: [B] int32 (num_accepted <= Lmax)."""
    if not (isinstance(ssm_pool, torch.Tensor) and ssm_pool.dim() == 4 and ssm_pool.dtype in STATE_DTYPES):
        check_tensor("ssm_pool", ssm_pool, [None] * 4, STATE_DTYPES)
    _need_contiguous("ssm_pool", ssm_pool)
    dev = ssm_pool.device
    if not (isinstance(scratch, torch.Tensor) and scratch.dim() == 5
            and _ok(scratch, (*scratch.shape[:2], *ssm_pool.shape[1:]), STATE_DTYPES, dev)):
        check_tensor("scratch", scratch, [None, None, *ssm_pool.shape[1:]], STATE_DTYPES, dev)
    _need_contiguous("scratch", scratch)
    if not (isinstance(slots, torch.Tensor) and slots.dim() == 1 and _ok(slots, (slots.shape[0],), _I32, dev)):
        check_index("slots", slots, None, dev)
    B = slots.shape[0]
    if B > MAX_GRID_Z:
        raise ValueError(f"slots: at most {MAX_GRID_Z} requests per call, got {B}")
    _need_index("scratch_rows", scratch_rows, B, dev)
    _need_index("num_accepted", num_accepted, B, dev)
    if resolve(backend, ssm_pool) == "triton":
        gdn_commit_fwd(ssm_pool, scratch, scratch_rows, slots, num_accepted)
    else:
        ok = (slots >= 0) & (num_accepted >= 1) & (scratch_rows >= 0)
        src = scratch[scratch_rows.clamp(min=0).long(), (num_accepted - 1).clamp(min=0).long()]
        _scatter_rows(ssm_pool, slots, ok, src)


def gdn_flush_pending(ssm_pool: torch.Tensor, slots: torch.Tensor, pending: GDNPending,
                      pending_in_rows: torch.Tensor, num_pending: torch.Tensor, *, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, backend: Backend = "auto") -> None:
    """Apply the accepted pending tokens and write the slot (no new tokens). ssm_pool:
    [S, HV, V, K]; slots, pending_in_rows, num_pending: [B] int32."""
    if not isinstance(pending, GDNPending):
        raise ValueError(f"pending: expected a GDNPending, got {type(pending).__name__}")
    # zero-row views of the pending buffers stand in for q/k/v/a/b (no allocation)
    k0, v0, a0, b0 = pending.k[:0, 0], pending.v[:0, 0], pending.a[:0, 0], pending.b[:0, 0]
    gdn_recurrent(k0, k0, v0, a0, b0, A_log, dt_bias, ssm_pool, slots, tokens_per_req=0,
                  write_state="after_pending", pending=pending, pending_in_rows=pending_in_rows,
                  num_pending=num_pending, backend=backend)


# ---------------------------------------------------------------- PyTorch path

def _scatter_rows(dst: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, val: torch.Tensor) -> None:
    """dst[idx[n]] = val[n] where ok[n], with no host read (graph-safe): rows that must not be
    written are redirected to the first written row with that row's value, or, if none is written,
    rewrite dst[0] with itself. Every duplicate index therefore carries an identical value."""
    if idx.shape[0] == 0:
        return
    val = val.to(dst.dtype)
    first = ok.to(torch.int32).argmax()
    some = ok[first]
    tgt = torch.where(ok, idx, torch.where(some, idx[first], 0)).long()
    fill = torch.where(some, val[first], dst[0])
    dst.index_put_((tgt,), torch.where(ok.view(-1, *[1] * (val.dim() - 1)), val, fill))


def gdn_recurrent_torch(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state,
                        scratch, scratch_rows, pending, pending_in_rows, num_pending, pending_out_rows,
                        scale, out):
    """Vectorised over requests (state gathered by slot, loop over tokens); same contract as
    gdn_recurrent, already validated."""
    B, L = slots.shape[0], tokens_per_req
    r = ssm_pool.shape[1] // k.shape[1]
    live = slots >= 0
    S = ssm_pool[slots.clamp(min=0).long()].to(F32)  # [B, HV, V, K]

    def step(S, kr, vr, ar, br):
        kn = l2norm(kr).repeat_interleave(r, 1)[:, :, None, :]  # [B, HV, 1, K]
        g, beta = gates(ar, br, A_log, dt_bias)
        S = S * torch.exp(g)[:, :, None, None]
        u = beta[:, :, None] * (vr.to(F32) - (S * kn).sum(-1))
        return S + u[..., None] * kn

    if pending_in_rows is not None:
        rows = pending_in_rows.clamp(min=0).long()
        n_app = torch.where(live & (pending_in_rows >= 0), num_pending, 0)
        pk, pv, pa, pb = pending.k[rows], pending.v[rows], pending.a[rows], pending.b[rows]
        for t in range(pk.shape[1]):
            S = torch.where((n_app > t)[:, None, None, None], step(S, pk[:, t], pv[:, t], pa[:, t], pb[:, t]), S)
        if write_state == "after_pending":  # without pending tokens the slot already holds S
            _scatter_rows(ssm_pool, slots, live, S)

    qs, ks, vs, as_, bs, os_ = (x.unflatten(0, (B, L)) for x in (q, k, v, a, b, out))
    for t in range(L):
        S = step(S, ks[:, t], vs[:, t], as_[:, t], bs[:, t])
        qn = (l2norm(qs[:, t]) * scale).repeat_interleave(r, 1)[:, :, None, :]
        os_[:, t] = torch.where(live[:, None, None], (S * qn).sum(-1), 0).to(out.dtype)
        if scratch is not None:
            _scatter_rows(scratch[:, t], scratch_rows, live & (scratch_rows >= 0), S)
    if pending_out_rows is not None:
        ok = live & (pending_out_rows >= 0)
        for dst, src in ((pending.k, ks), (pending.v, vs), (pending.a, as_), (pending.b, bs)):
            _scatter_rows(dst[:, :L], pending_out_rows, ok, src)
    if write_state == "final":
        _scatter_rows(ssm_pool, slots, live, S)
    return out
