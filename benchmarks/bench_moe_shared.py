"""The whole MoE block (``layers.moe.SparseMoE``: router GEMM, router, routed experts, shared expert) with the
shared expert folded into the routed grouped GEMM (expert E, k+1 pairs per token) against the same block
unfolded (a separate dense MLP + sigmoid gate after the routed experts), on the same weights.

Shape: the Qwen3.5-35B-A3B block (hidden 2048, 256 experts of 512, top-8, shared expert 512), bf16, T tokens
of random activations. Per row: GPU µs of one block call from a CUDA-graph replay (``timing.time_call``:
median [P10–P90]), kernels per call (torch.profiler, one eager call), the weight bytes the call must read
(router + distinct experts hit + the shared expert, x 3 H I x 2 bytes) as TB/s, and rel-RMS against a float64
copy of the block on the first 8 tokens.

    python -m benchmarks.bench_moe_shared --out benchmarks/results/moe_shared_h200.md      (CUDA)
"""
from __future__ import annotations

import argparse
import copy
import platform
import subprocess
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.timing import time_call
from gdnserve.layers.moe import SparseMoE
from gdnserve.ops.numerics import rel_rms
from benchmarks import jsonfmt

H, I, K = 2048, 512, 8


def kernels_per_call(fn, cuda: bool) -> int | None:
    """CUDA kernels (and copies) one call launches; None off CUDA."""
    if not cuda:
        return None
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@torch.no_grad()
def to_fp8(moe: SparseMoE) -> None:
    """``moe`` as an FP8 release's block (``models.loader.quantize_model_fp8_``'s steps for one block): the shared
    expert's two layers and the routed experts in 128x128 blocks, then the shared expert folded again."""
    from gdnserve.models.loader import quantize_experts_fp8_, quantize_linear_fp8_
    moe.unfold_shared()
    assert quantize_linear_fp8_(moe.shared_expert.gate_up_proj) and quantize_linear_fp8_(moe.shared_expert.down_proj)
    assert quantize_experts_fp8_(moe) and moe.fold_shared()


def block(E: int, dev: torch.device, H: int = H, I: int = I) -> SparseMoE:
    moe = SparseMoE(H, E, K, I, I, True).to(device=dev, dtype=torch.bfloat16).eval()
    gen = torch.Generator(device=dev).manual_seed(E)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02, generator=gen)
    assert moe.fold_shared()
    moe.backend = "triton"
    return moe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe_shared", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,16,64,256,4096")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/moe_shared_h200.md")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (Triton interpreted; use small shapes)")
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--intermediate", type=int, default=I)
    ap.add_argument("--fp8", action="store_true", help="the block quantized to block FP8 (models.loader."
                    "quantize_model_fp8_, the shared expert folded again); rel-RMS against the bf16 block's f64 copy")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    E, hidden, inter = a.experts, a.hidden, a.intermediate
    moe = block(E, dev, hidden, inter)
    ref64 = copy.deepcopy(moe).double()
    ref64.backend = "torch"
    if a.fp8:
        to_fp8(moe)
    rows = []
    for T in map(int, a.tokens.split(",")):
        gen = torch.Generator(device=dev).manual_seed(T)
        xs = [torch.randn(T, hidden, device=dev, generator=gen).bfloat16() for _ in range(2)]
        with torch.no_grad():
            hit = int(torch.unique(ref64.route(xs[0].double())[1]).numel())
            want = ref64(xs[0][:8].double())
        bytes_ = (hit + 1) * 3 * hidden * inter * (1 if a.fp8 else 2) + (E + 1) * hidden * 2
        outs = {}
        for name, fold in (("unfolded", 0), ("folded", 1 << 30)):
            moe.fold_max_tokens = fold          # forced either way (the default folds up to FOLD_MAX_TOKENS)

            def call(x, moe=moe):
                with torch.no_grad():
                    return moe(x)
            outs[name] = call(xs[0])
            r = time_call(call, iters=a.iters, warmup=2, rotate=xs, device=dev)
            g = r["gpu_us"]
            rows.append({"T": T, "variant": name, "gpu_us": g, "method": r["gpu_method"],
                         "kernels": kernels_per_call(lambda: call(xs[0]), cuda), "experts_hit": hit,
                         "TBps": bytes_ / (g["p50"] * 1e-6) / 1e12, "rel_rms_vs_f64": rel_rms(outs[name][:8], want)})
            print(rows[-1], flush=True)
        rows[-1]["rel_rms_vs_unfolded"] = rel_rms(outs["folded"], outs["unfolded"])
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip() or "unknown"
    name = torch.cuda.get_device_name(dev) if cuda else f"CPU smoke run ({platform.machine()}, Triton interpreted)"
    fmt = "block FP8 (e4m3, 128x128 scales; router bf16)" if a.fp8 else "bf16"
    lines = [f"# MoE block, shared expert folded into the grouped GEMM vs unfolded — {name}",
             "",
             f"torch {torch.__version__}, Python {platform.python_version()}; commit {commit}; command "
             f"`python -m benchmarks.bench_moe_shared --tokens {a.tokens} --experts {E}" + (" --fp8" if a.fp8 else "")
             + (f" --device {a.device} --hidden {hidden} --intermediate {inter}" if not cuda else "") + "`.",
             f"Block: hidden {hidden}, {E} experts of {inter}, top-{K}, shared expert {inter}, {fmt}, Triton backend, fused router. "
             "GPU µs per block call from a CUDA-graph replay, median [P10–P90]; kernels per call from torch.profiler; "
             "TB/s = (router + distinct experts hit + shared) weight bytes / median.", "",
             "| T | experts hit | unfolded µs | kernels | folded µs | kernels | speed-up | folded TB/s | "
             "rel-RMS f64 unfolded / folded | folded vs unfolded |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for u, f in zip(rows[0::2], rows[1::2]):
        gu, gf = u["gpu_us"], f["gpu_us"]
        lines.append(f"| {u['T']} | {u['experts_hit']} | {gu['p50']:.1f} [{gu['p10']:.1f}–{gu['p90']:.1f}] | "
                     f"{u['kernels']} | {gf['p50']:.1f} [{gf['p10']:.1f}–{gf['p90']:.1f}] | {f['kernels']} | "
                     f"{gu['p50'] / gf['p50']:.2f}x | {f['TBps']:.2f} | {u['rel_rms_vs_f64']:.1e} / "
                     f"{f['rel_rms_vs_f64']:.1e} | {f['rel_rms_vs_unfolded']:.1e} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(jsonfmt.dumps({"commit": commit, "rows": rows}))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
