"""Chunked gated-delta-rule prefill over a slot-indexed SSM state pool.

Public entry: :func:`chunk_gated_delta_rule`. PyTorch path in ``chunk_torch.py``, Triton kernels
in ``chunk_triton.py``; both implement the same semantics (documented below) and are tested
against the float64 reference ``naive.naive_prefill_pool``.
"""
from __future__ import annotations

import torch

from gdnserve.ops import backend as _backend
from gdnserve.ops.checks import ACT_DTYPES, STATE_DTYPES, check_contiguous, check_index, check_tensor
from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
from gdnserve.ops.varlen import VarlenMeta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_pool: torch.Tensor, meta: VarlenMeta,
                           src_slots: torch.Tensor, dst_slots: torch.Tensor, parents: torch.Tensor | None = None,
                           *, scale: float | None = None, out: torch.Tensor | None = None,
                           workspace: ChunkWorkspace | None = None, backend: _backend.Backend = "auto") -> torch.Tensor:
    """Prefill N packed sequences with the gated delta rule, reading and writing pool slots in-kernel.

    q, k:      [T, H, K]   raw (pre-l2norm) post-conv q/k; last-dim stride 1 (views of a packed buffer ok)
    v:         [T, HV, V]  HV = r * H for an integer r >= 1; value head j uses key head j // r
    a, b:      [T, HV]     raw gate projections: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    A_log:     [HV] fp32;  dt_bias: [HV]
    ssm_pool:  [S, HV, V, K] fp32 or bf16, contiguous; pool[s, j] holds S_j^T (V-major, K contiguous)
    meta:      VarlenMeta of the N sequence lengths (cu_seqlens, chunk_indices, chunk_offsets)
    src_slots: [N] int32   initial state slot, -1 = zeros
    dst_slots: [N] int32   final state slot, -1 = do not write; src == dst (in place) and src != dst
                           (copy-on-write fork) are both fine
    parents:   [N] int32 or None; parents[n] = p >= 0 makes sequence p's final state (rounded to the
               pool dtype, exactly as if p had been run first and written to a slot) n's initial
               state. p must come before n (p < n), have no parent itself and a dst slot (>= 0: the
               Triton state pass hands the state over through it), and p's src slot must not be any
               sequence's dst (the caller's plan guarantees all of these; the kernels do not check).
    returns o: [T, HV, V] in v.dtype (``out`` if given), o_t = S_t^T (scale * l2norm(q_t)),
               scale = K ** -0.5 by default.
    All reads of the pool happen before any write a sequence could observe, so a slot can be read by
    one sequence and written by the same sequence; a slot written by one sequence must not be read
    by another in the same call.
    """
    T, H, K = _shape3("q", q)
    HV, V = _shape3("v", v)[1:]
    dev = q.device
    check_tensor("q", q, [T, H, K], ACT_DTYPES, dev)
    check_tensor("k", k, [T, H, K], [q.dtype], dev)
    check_tensor("v", v, [T, HV, V], [q.dtype], dev)
    check_tensor("a", a, [T, HV], ACT_DTYPES, dev)
    check_tensor("b", b, [T, HV], ACT_DTYPES, dev)
    check_tensor("A_log", A_log, [HV], [torch.float32], dev)
    check_tensor("dt_bias", dt_bias, [HV], ACT_DTYPES, dev)
    check_tensor("ssm_pool", ssm_pool, [None, HV, V, K], STATE_DTYPES, dev)
    check_contiguous("ssm_pool", ssm_pool)
    if HV % H != 0:
        raise ValueError(f"v: value heads HV={HV} must be a multiple of key heads H={H}")
    if K > 256 or V > 256:
        raise ValueError(f"q/v: head dims K={K}, V={V} must be <= 256")
    if meta.num_tokens != T:
        raise ValueError(f"meta: describes {meta.num_tokens} tokens, q has {T}")
    n = meta.num_seqs
    check_index("src_slots", src_slots, n, dev)
    check_index("dst_slots", dst_slots, n, dev)
    if parents is not None:
        check_index("parents", parents, n, dev)
    if out is None:
        out = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    else:
        check_tensor("out", out, [T, HV, V], [v.dtype], dev)
        check_contiguous("out", out)
    scale = K ** -0.5 if scale is None else float(scale)
    if _backend.resolve(backend, q) == "torch":
        from gdnserve.ops.gdn.chunk_torch import chunk_gdn_torch
        return chunk_gdn_torch(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta, src_slots, dst_slots, parents,
                               scale, out)
    from gdnserve.ops.gdn.chunk_configs import chunk_config
    cfg = chunk_config(dev)
    if cfg.fused_main:          # the two-launch path in FlashQLA's shape (docs/kernels.md), off by default
        from gdnserve.ops.gdn.chunk_fused_triton import chunk_gdn_fused
        from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
        ws = ChunkWorkspace.ensure(workspace, meta, HV, K, V, v.dtype, dev)
        return chunk_gdn_fused(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta, src_slots, dst_slots, parents, scale,
                               out, ws, cfg)
    from gdnserve.ops.gdn.chunk_triton import chunk_gdn_triton
    return chunk_gdn_triton(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta, src_slots, dst_slots, parents,
                            scale, out, workspace)


def _shape3(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"{name}: expected a 3-d tensor, got {getattr(t, 'shape', type(t).__name__)}")
    return tuple(t.shape)  # type: ignore[return-value]

