"""Which chunk-kernel launch config breaks at small head dims on the GPU? Each variant runs in its
own process (an illegal access poisons the CUDA context). Usage: python -m benchmarks.diag_chunk_configs"""
import json
import subprocess
import sys

CASE = r'''
import json, sys, torch
from gdnserve.ops.gdn import chunk_triton as ct
for kk, vv in json.loads(sys.argv[1]).items(): setattr(ct, kk, vv)
from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
from gdnserve.ops.gdn.naive import naive_prefill_pool
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.varlen import VarlenMeta
from tests.ops.gdn_inputs import gdn_inputs, random_pool, idx
res = []
for (H, HV, K, V) in [(2, 2, 16, 32), (2, 6, 32, 16), (1, 4, 24, 40), (2, 4, 64, 64), (16, 32, 128, 128)]:
    lens = [1, 63, 64, 65, 130]
    q, k, v, a, b, A, dt = gdn_inputs(sum(lens), H, HV, K, V, torch.bfloat16, "cuda")
    pool = random_pool(12, HV, V, K, torch.float32, "cuda")
    src, dst = [3, -1, 5, 6, 7], [8, 9, 5, 10, 11]
    ro, rp = naive_prefill_pool(q, k, v, a, b, A, dt, pool, lens, src, dst)
    o = chunk_gated_delta_rule(q, k, v, a, b, A, dt, pool, VarlenMeta.build(lens, "cuda"), idx(src, "cuda"), idx(dst, "cuda"))
    torch.cuda.synchronize()
    res.append(f"{H},{HV},{K},{V}: o {rel_rms(o, ro):.1e} s {rel_rms(pool, rp):.1e}")
print(" | ".join(res))
'''
VARIANTS = [{}, {"PREP_BF16": False}, {"PREP_WARPS": 4}, {"INV_MODE": 0}, {"OUT_F32": True}, {"STATE_F32": True}, {"STATE_BV": 64},
            {"PREP_WARPS": 8}, {"OUT_BV": 64}]
for var in VARIANTS:
    r = subprocess.run([sys.executable, "-c", CASE, json.dumps(var)], capture_output=True, text=True, timeout=120)
    msg = r.stdout.strip() if r.returncode == 0 else "FAIL " + (r.stderr.strip().splitlines() or ["?"])[-1][:160]
    print(json.dumps(var), "->", msg, flush=True)
