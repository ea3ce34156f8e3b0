"""One small chunked prefill under compute-sanitizer (python -m benchmarks.sanitize_prep [NAME=VALUE ...]):
finds which access of a chunk-kernel config faults (the 4-warp bf16 prep at K < 128, docs/kernels.md)."""
import sys

import torch

from gdnserve.ops.gdn import chunk_triton as ct
from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
from gdnserve.ops.varlen import VarlenMeta
from tests.ops.gdn_inputs import gdn_inputs, idx, random_pool

for kv in sys.argv[1:]:
    name, val = kv.split("=")
    setattr(ct, name, type(getattr(ct, name))(eval(val)))
H, HV, K, V = 2, 2, 16, 32
lens = [1, 63, 64, 65, 130]
q, k, v, a, b, A, dt = gdn_inputs(sum(lens), H, HV, K, V, torch.bfloat16, "cuda")
pool = random_pool(12, HV, V, K, torch.float32, "cuda")
o = chunk_gated_delta_rule(q, k, v, a, b, A, dt, pool, VarlenMeta.build(lens, "cuda"), idx([3, -1, 5, 6, 7], "cuda"),
                           idx([8, 9, 5, 10, 11], "cuda"))
torch.cuda.synchronize()
print("ok", o.float().abs().mean().item())
