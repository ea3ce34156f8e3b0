"""``gdnserve serve`` on a random-weight model (benchmarks/random_model.py), for the HTTP serving benchmark
(benchmarks/bench_serve_http.py): the full-size Qwen3.5-35B-A3B shapes have no checkpoint on disk (70 GB in bf16),
so this launcher builds the model in place and hands it to the real server (``run_serve``: the same flags, memory
plan, banner and server; only the loader differs). Every ``gdnserve serve`` flag but ``--model``, plus:

  --shape full | bench | tiny   the 40-layer 256-expert model (default), the 8-layer 64-expert cut, the CPU smoke shape
  --fp8                         block-FP8 GEMMs and experts after building (the FP8 release's layout,
                                ``quantize_model_fp8_``)
  --seed N                      the weights' seed
  --spec-oracle RATE            with --spec-k K: oracle drafts, RATE x K of them accepted per step on average
                                (``benchmarks/oracle_drafter.py``): the model gets a greedy chain
                                (``make_greedy_chain_``, so the greedy continuation of any prompt is known) and the
                                drafter's proposals (the MTP head's, after it ran: ``--spec-draft mtp``; else the
                                n-gram drafter's) become that chain, the first floor(RATE x K + u) right. Measures
                                speculative decoding at a set acceptance with greedy requests (temperature 0)

With ``--spec-draft mtp`` the model gets one MTP layer (Qwen3.5-35B-A3B ships one), randomly initialised.

The memory plan runs before the model is built (bf16 weights: the build's peak). The tokenizer is one character per
token (:class:`CharTokenizer`): generated text round-trips to the same ids, and a streamed chunk's characters count
its tokens; the model has no EOS.

    python -m benchmarks.serve_random --shape full --device cuda --port 8000 [--fp8] [--gpu-memory-utilization 0.9]
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from gdnserve.models.tokenizer import CHATML_TEMPLATE, BaseTokenizer

PLANE = 0x10000     # token i <-> chr(PLANE + i): no surrogate, no U+FFFD, one code point per token


class CharTokenizer(BaseTokenizer):
    """Token id i is the code point PLANE + i; other characters encode to ord(c) % vocab (ASCII text: one token per
    character). No special tokens, no EOS; the byte tokenizer's ChatML template."""
    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, str] = {}
    chat_template = CHATML_TEMPLATE

    def __init__(self, vocab_size: int) -> None:
        self._vocab = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def special_strings(self) -> tuple[str, ...]:
        return ()

    def encode(self, text: str, special: bool = True) -> list[int]:
        V = self._vocab
        return [o - PLANE if PLANE <= (o := ord(c)) < PLANE + V else o % V for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(PLANE + int(i)) for i in ids)


def random_hf_config(shape: str) -> dict:
    from benchmarks.random_model import bench_hf_config, full_hf_config, tiny_hf_config
    return {"full": full_hf_config, "bench": bench_hf_config, "tiny": tiny_hf_config}[shape]()


def load_random_engine(model: str | None, *, dtype: str | None, device: str, config, shape: str, fp8: bool,
                       seed: int, spec_oracle: float | None = None):
    """``load_engine``'s signature (``run_serve`` calls it): the random model of ``shape``, planned before it is
    built (raises MemoryPlanError naming the field), then an LLMEngine over it."""
    import torch

    from benchmarks.oracle_drafter import install_chain_oracle
    from benchmarks.random_model import build_random_model, make_greedy_chain_
    from gdnserve.engine.llm_engine import LLMEngine
    from gdnserve.engine.memory.memory_budget import config_weights_bytes, resolve_pools
    from gdnserve.models.config import ModelConfig
    from gdnserve.models.loader import quantize_model_fp8_
    if config.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: the random-model launcher runs one process (benchmarks/bench_tp.py "
                         "covers tensor parallelism)")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    hf = random_hf_config(shape)
    if config.spec_k and config.spec_draft == "mtp":
        hf["mtp_num_hidden_layers"] = 1
    if spec_oracle is not None and not config.spec_k:
        raise ValueError("spec_oracle (--spec-oracle) needs speculative decoding: --spec-k K")
    model_cfg = ModelConfig.from_hf(hf)
    if config.model_name == "gdnserve-embedded":
        config = config.with_(model_name=f"random-{shape}{'-fp8' if fp8 else ''}")
    resolve_pools(config, model_cfg, dt, dev, weights=config_weights_bytes(model_cfg, dt))   # refuse before building
    net = build_random_model(hf, dev, dt, seed)
    perm = None
    if spec_oracle is not None:
        with torch.no_grad():
            perm = make_greedy_chain_(net)
    if fp8:
        quantize_model_fp8_(net)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    engine = LLMEngine(net, CharTokenizer(model_cfg.vocab_size), config)
    if perm is not None:
        install_chain_oracle(engine, perm, spec_oracle)
    return engine


def main(argv: Sequence[str] | None = None) -> int:
    from functools import partial

    from gdnserve.entrypoints.serve import add_serve_arguments, run_serve
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_random", description=__doc__.split("\n\n")[0])
    add_serve_arguments(p)
    p.add_argument("--shape", choices=["full", "bench", "tiny"], default="full",
                   help="full: 40 layers, 256 experts (default); bench: 8 layers, 64 experts; tiny: the CPU shape")
    p.add_argument("--fp8", action="store_true", help="block-FP8 GEMMs and experts (quantized after building)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec-oracle", type=float, default=None, metavar="RATE",
                   help="with --spec-k: oracle drafts, RATE x k accepted per step on average (greedy requests)")
    args = p.parse_args(argv)
    if args.model is not None:
        print("serve_random: --model: this launcher serves a random model; use gdnserve serve --model",
              file=sys.stderr)
        return 2
    if args.spec_oracle is not None and not (0 <= args.spec_oracle <= 1 and args.spec_k):
        print("serve_random: --spec-oracle RATE needs 0 <= RATE <= 1 and --spec-k K > 0", file=sys.stderr)
        return 2
    args.load_engine = partial(load_random_engine, shape=args.shape, fp8=args.fp8, seed=args.seed,
                               spec_oracle=args.spec_oracle)
    oracle = "" if args.spec_oracle is None else f", greedy chain + {args.spec_draft} oracle drafts at " \
        f"{args.spec_oracle:g}"
    args.model_desc = f"random weights, {args.shape} Qwen3.5-35B-A3B shapes{', FP8' if args.fp8 else ''}{oracle}"
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
