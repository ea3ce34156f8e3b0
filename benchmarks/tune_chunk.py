"""Offline tuning of the chunked prefill on the GPU: each of the three launches timed alone for
several launch configs, with the error of each variant against our fp32 PyTorch path, beside fla.
Run on the device: python -m benchmarks.tune_chunk  (writes $OUT/tune_chunk.json)."""
from __future__ import annotations

import itertools
import json
import os

import torch

from gdnserve.ops.gdn import chunk_triton as ct
from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.varlen import VarlenMeta

H, HV, K, V = 16, 32, 128, 128
dev = "cuda"


def events(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return round(ts[len(ts) // 2], 1)


def inputs(lens):
    T = sum(lens)
    D = 2 * H * K + HV * V
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    q, k, v = x[:, :H * K].view(T, H, K), x[:, H * K:2 * H * K].view(T, H, K), x[:, 2 * H * K:].view(T, HV, V)
    a = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    b = torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
    dt_bias = torch.rand(HV, device=dev)
    return q, k, v, a, b, A_log, dt_bias


def setv(var):
    for kk, vv in var.items():
        setattr(ct, kk, vv)


def main():
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.utils.index import prepare_chunk_indices
        have_fla = True
    except Exception as e:  # pragma: no cover
        print("no fla:", e); have_fla = False
    base = {kk: getattr(ct, kk) for kk in ('PREP_WARPS', 'INV_MODE', 'PREP_BF16', 'STATE_F32', 'STATE_BV', 'STATE_WARPS',
                                         'OUT_F32', 'OUT_BV', 'OUT_WARPS')}
    prep_vars = [dict(INV_MODE=m, PREP_WARPS=w, PREP_BF16=bf) for m, w, bf in itertools.product([0, 1], [4, 8], [True, False])]
    state_vars = [dict(STATE_F32=f, STATE_BV=bv, STATE_WARPS=w) for f, bv, w in
                  itertools.product([True, False], [16, 32, 64], [4, 8])]
    out_vars = [dict(OUT_F32=f, OUT_BV=bv, OUT_WARPS=w) for f, bv, w in itertools.product([True, False], [64, 128], [4, 8])]
    stages = os.environ.get("STAGES", "prep,state,out").split(",")
    shapes = [[32768], [256] * 64, [512] + [64] * 16][:int(os.environ.get("NSHAPES", "3"))]
    for lens in shapes:
        T, N = sum(lens), len(lens)
        q, k, v, a, b, A_log, dt_bias = inputs(lens)
        pool = torch.randn(2 * N + 2, HV, V, K, device=dev) * 0.1
        meta = VarlenMeta.build(lens, dev)
        src = torch.arange(N, dtype=torch.int32, device=dev)
        dst = torch.arange(N, 2 * N, dtype=torch.int32, device=dev)
        ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, torch.bfloat16, dev)
        o = torch.empty(T, HV, V, device=dev, dtype=torch.bfloat16)
        row = {"shape": f"{N}x{lens[0]}" if len(set(lens)) == 1 else "1P512+16C64(independent)", "T": T}
        ref_pool = pool.clone()
        ref_o = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ref_pool, meta, src, dst, backend="torch")

        def check(name):
            p = pool.clone()
            chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, src, dst, out=o, workspace=ws)
            row[name + "_err"] = (round(rel_rms(o, ref_o), 5), round(rel_rms(p[N:2 * N], ref_pool[N:2 * N]), 5))
            return p
        for stage, vars_, fn in [
            ("prep", prep_vars, lambda p: ct.launch_prep(q, k, v, a, b, A_log, dt_bias, meta, ws)),
            ("state", state_vars, lambda p: ct.launch_state(k, v, p, meta, src, dst, None, ws)),
            ("out", out_vars, lambda p: ct.launch_output(q, k, v, meta, K ** -0.5, o, ws)),
        ]:
            if stage not in stages:
                continue
            for var in vars_:
                setv(base); setv(var)
                name = stage + ":" + ",".join(f"{kk}={int(vv) if isinstance(vv, bool) else vv}" for kk, vv in var.items())
                p = check(name)
                row[name] = events(lambda: fn(p))
        setv(base)
        p = check("full")
        row["full"] = events(lambda: chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, p, meta, src, dst,
                                                            out=o, workspace=ws))
        if have_fla:
            g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
            beta = b.float().sigmoid()
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.long)
            ci = prepare_chunk_indices(cu, 64)
            h0 = pool[:N].clone()

            def fla_call():
                return fla_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
                                 cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), chunk_indices=ci)
            fo, fs = fla_call()
            row["fla_err"] = (round(rel_rms(fo[0], ref_o), 5), round(rel_rms(fs, ref_pool[N:2 * N]), 5))
            row["fla"] = events(fla_call)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tune_chunk.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
