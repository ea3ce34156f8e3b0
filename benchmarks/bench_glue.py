"""The small glue ops of a prefill step, PyTorch against Triton, GPU µs per call (``timing.time_call``: CUDA
graph replays): the MoE expert alignment (``align.align_pairs``'s ~25 torch ops with two radix sorts, the
one-program kernel up to ``MAX_PAIRS`` pairs, the multi-program count + scatter of ``align_multi``) and the
gating epilogues of ``ops/gating`` (shared expert silu * up and gate + add; attention output gate).

    python -m benchmarks.bench_glue --out benchmarks/results/glue_h200.md [--quick]

Every Triton result is checked against the PyTorch one first (alignment bit for bit; gating within one bf16
rounding). Shapes: Qwen3.5-35B-A3B (256 experts top-8, + the folded shared expert = 257 experts top-9;
hidden 2048, I 512; attention 16 heads of 256); tokens 1, 64, 256, 1024, 4096, 8192.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.timing import time_call
from gdnserve.ops.gating import sigmoid_mul, silu_mul
from gdnserve.ops.moe.align import align_pairs
from gdnserve.ops.moe.align_multi import align_pairs_multi
from gdnserve.ops.moe.align_triton import MAX_PAIRS, align_pairs_triton
from gdnserve.ops.moe.grouped_triton import block_rows


def us(fn) -> float:
    return time_call(fn, iters=10, warmup=2)["gpu_us"]["p50"]


def alignment_rows(tokens: list[int], dev: torch.device) -> list[str]:
    out = ["| tokens | experts x k | pairs | align_pairs (torch) µs | one program µs | multi-program µs |",
           "| --- | --- | --- | --- | --- | --- |"]
    for T in tokens:
        for E, k in ((256, 8), (257, 9)):
            logits = torch.randn(T, E, device=dev)
            if k == 9:       # the folded shared expert: a 9th pair per token, expert 256
                ids = torch.cat([logits.topk(8, dim=1).indices, torch.full((T, 1), 256, device=dev)], 1)
            else:
                ids = logits.topk(k, dim=1).indices
            ids = ids.to(torch.int32).contiguous()
            N, BM = ids.numel(), block_rows(ids.numel(), E)
            ref, multi = align_pairs(ids, E, BM), align_pairs_multi(ids, E, BM)
            assert torch.equal(ref.rows, multi.rows) and torch.equal(ref.block_expert, multi.block_expert), (T, E)
            one = "-"
            if N <= MAX_PAIRS:
                a = align_pairs_triton(ids, E, BM)
                assert torch.equal(ref.rows, a.rows) and torch.equal(ref.block_expert, a.block_expert)
                one = f"{us(lambda: align_pairs_triton(ids, E, BM)):.1f}"
            out.append(f"| {T} | {E} x {k} | {N} | {us(lambda: align_pairs(ids, E, BM)):.1f} | {one} | "
                       f"{us(lambda: align_pairs_multi(ids, E, BM)):.1f} |")
    return out


def gating_rows(tokens: list[int], dev: torch.device) -> list[str]:
    bf = torch.bfloat16
    out = ["| tokens | op | PyTorch ops µs | Triton µs |", "| --- | --- | --- | --- |"]

    def check(a, b):          # within a bf16 rounding of the largest value (a sum may cancel)
        assert (a.float() - b.float()).abs().max() <= b.float().abs().max() * 2.0 ** -7
    for T in tokens:
        h = torch.randn(T, 1024, device=dev, dtype=bf)
        x, o, g1 = (torch.randn(T, 2048, device=dev, dtype=bf), torch.randn(T, 2048, device=dev, dtype=bf),
                    torch.randn(T, 1, device=dev, dtype=bf))
        qg = torch.randn(T, 16, 512, device=dev, dtype=bf)
        att, gate = torch.randn(T, 4096, device=dev, dtype=bf), qg[..., 256:]
        cases = [("shared silu * up [T, 2x512]", lambda be: silu_mul(h, backend=be)),
                 ("shared add + h * sigmoid(g) [T, 2048]", lambda be: sigmoid_mul(x, g1, o, backend=be)),
                 ("attention o * sigmoid(gate) [T, 16x256]",
                  lambda be: sigmoid_mul(att, gate if be == "triton" else gate.reshape(T, 4096), backend=be))]
        for name, f in cases:
            check(f("triton"), f("torch"))
            if name.startswith("attention"):     # the PyTorch path's reshape copy of the strided gate included
                t_torch = us(lambda: att * torch.sigmoid(gate.reshape(T, 4096)))
            else:
                t_torch = us(lambda f=f: f("torch"))
            out.append(f"| {T} | {name} | {t_torch:.1f} | {us(lambda f=f: f('triton')):.1f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_glue")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tokens 256, 1024, 4096, 8192 only")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    tokens = [256, 1024, 4096, 8192] if a.quick else [1, 64, 256, 1024, 4096, 8192]
    lines = [f"# Prefill glue ops, PyTorch vs Triton ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}; `python -m benchmarks.bench_glue {' '.join(argv or [])}`; GPU µs per call "
             "(median of CUDA-graph replays).", "", "## MoE expert alignment", ""]
    lines += alignment_rows(tokens, dev)
    lines += ["", "## Gating epilogues (bf16)", ""] + gating_rows(tokens, dev)
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
