"""``gdnserve serve``: the OpenAI-compatible HTTP server on the embedded default model or an HF checkpoint."""
from __future__ import annotations

import argparse

from gdnserve.engine.config import EngineConfig

_D = EngineConfig()     # the defaults live there, once


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint folder; default: the embedded tiny model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every request")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefill-mode", default=_D.prefill_mode, choices=["serial", "two_phase", "two_phase_indexed", "fused"],
                   help="grouped producer/consumer prefill executor (default fused)")
    p.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs, help="concurrently running sequences")
    p.add_argument("--max-model-len", type=int, default=_D.max_model_len, help="prompt + generated tokens per sequence")
    p.add_argument("--num-pages", type=int, default=_D.num_pages, help="KV pages of 16 tokens per attention layer")
    p.add_argument("--spec-k", type=int, default=_D.spec_k, help="speculative decoding: drafts verified per step (0 = off)")
    p.add_argument("--spec-draft", default=_D.spec_draft, choices=["ngram", "mtp"],
                   help="drafter: ngram (prompt lookup, no weights) or mtp (the checkpoint's mtp.* head)")
    p.add_argument("--spec-mode", default=_D.spec_mode, choices=["replay", "intermediate"],
                   help="GDN verify mode: replay (pending inputs, one state read+write) or intermediate (scratch states)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run decode and verify steps eagerly (default: bucketed CUDA graphs on a CUDA device)")


def run_serve(args: argparse.Namespace) -> int:
    from gdnserve.engine.async_engine import AsyncEngine
    from gdnserve.entrypoints.llm import load_engine
    from gdnserve.entrypoints.server import run_server
    cfg = EngineConfig(model_name=args.model or "gdnserve-embedded", prefill_mode=args.prefill_mode,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, num_pages=args.num_pages,
                       spec_k=args.spec_k, spec_mode=args.spec_mode, spec_draft=args.spec_draft,
                       cuda_graphs=args.cuda_graphs)
    engine = load_engine(args.model, dtype=args.dtype, device=args.device, config=cfg)
    run_server(AsyncEngine(engine), host=args.host, port=args.port, api_key=args.api_key)
    return 0
