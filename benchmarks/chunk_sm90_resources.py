"""Registers, stack frame (spills) and shared memory of the chunked-prefill kernels compiled for sm_90a on a machine
without a GPU (Triton's bundled ptxas and cuobjdump), at the Qwen3.5-35B-A3B GDN shape (H 16, HV 32, K = V = 128,
bf16 activations, fp32 pool), 4 warps, 3 stages:

    python -m benchmarks.chunk_sm90_resources

A stack frame above 0 means spills (255 registers is the cap). Figures quoted in docs/kernels.md ("Chunked prefill
against FlashQLA")."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H, HV, K, V = 16, 32, 128, 128
BF, F32, I32 = "*bf16", "*fp32", "*i32"


def resources(fn, types: dict[str, str], consts: dict, warps: int = 4, stages: int = 3) -> dict:
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kern.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.DOTALL)
    return {"regs": int(m[1]) if m else None, "stack": int(m[2]) if m else None, "shared": kern.metadata.shared}


def main() -> None:
    from gdnserve.ops.gdn import chunk_fused_triton as fused
    from gdnserve.ops.gdn import chunk_state_triton as state
    from gdnserve.ops.gdn import chunk_triton as old
    common = {"R": HV // H, "HV": HV, "K": K, "BK": 128, "C": 64, "DOT_PREC": "tf32"}
    prep = {"INV_MODE": 1, "PREP_BF16": True, "SPLIT": HV // H, "INV_BF16": True, "SHORT": 32, "SHORT_NIT": 3}
    rows = []
    t = dict.fromkeys(("q", "k", "v", "a", "b", "w", "u", "kn", "qp", "o", "dt_bias"), BF)
    t.update(A_log=F32, gcum=F32, cu_seqlens=I32, chunk_indices=I32, scale="fp32")
    rows.append(("chunk_prep_kernel (H200 row)", resources(old.chunk_prep_kernel, t, {
        **common, **prep, "V": V, "BV": 128})))
    t = dict.fromkeys(("kn", "qp", "w", "u", "o"), BF)
    t.update(gcum=F32, pool=F32, seg_b=F32, seg_p=F32, cu_seqlens=I32, chunk_offsets=I32, src_slots=I32,
             dst_slots=I32, parents=I32, sync=I32)
    rows.append(("chunk_state_kernel (BV 32)", resources(state.chunk_state_kernel, t, {
        **common, "V": V, "BV": 32, "CP": False, "CP_MIN": 1 << 30, "SEG": 16, "HAS_PARENT": False,
        "TICKETS": False, "COMB_PREC": "tf32", "CB": 32, "PHASE": 0})))
    t = dict.fromkeys(("q", "k", "a", "b", "tm_t", "tm_m", "dt_bias", "qn", "kn"), BF)
    t.update(A_log=F32, gcum=F32, cu_seqlens=I32, chunk_indices=I32, scale="fp32")
    rows.append(("chunk_prep_tm_kernel", resources(fused.chunk_prep_tm_kernel, t, {
        **common, **prep, "QK_STORE": True})))
    t = dict.fromkeys(("q", "k", "v", "tm_t", "tm_m", "o", "qn", "kn"), BF)
    t.update(gcum=F32, pool=F32, cu_seqlens=I32, src_slots=I32, dst_slots=I32, parents=I32, scale="fp32",
             cp_decay="fp32")
    for bv, cp in ((16, False), (32, False), (64, False), (32, True)):
        rows.append((f"chunk_main_kernel (BV {bv}{', CP' if cp else ''})", resources(fused.chunk_main_kernel, t, {
            **common, "V": V, "BV": bv, "HAS_PARENT": False, "PHASE": 0, "QK_STORE": True, "CP": cp,
            "CP_MIN": 64, "SEG": 32, "TF32": False})))
    print(f"Triton {triton.__version__}, sm_90a, 4 warps, 3 stages")
    for name, r in rows:
        print(f"{name:32s} registers {r['regs']}, stack {r['stack']} B, shared {r['shared']} B")


if __name__ == "__main__":
    main()
