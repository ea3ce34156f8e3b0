"""``gdnserve generate``: greedy continuation of one prompt on the embedded default model or an HF
checkpoint folder, through the ModelRunner (prefill, then decode step by step). Sampling, batching and
streaming come with the engine loop; this is the smallest end-to-end path through every layer."""
from __future__ import annotations

import argparse
import sys
import time


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="HF checkpoint folder (config.json + safetensors + tokenizer.json); "
                                                  "default: the embedded tiny model (random weights)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights/activations dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes, one GPU each (gloo processes on CPU); default 1")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run the decode steps eagerly (default: a CUDA graph per batch-size bucket on CUDA)")


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from gdnserve.engine.cache.sequence import PrefillItem
    from gdnserve.engine.execution.model_runner import ModelRunner
    from gdnserve.entrypoints.preflight import (
        PreflightError,
        check_device,
        check_model_folder,
    )
    from gdnserve.entrypoints.serve import engine_config
    from gdnserve.models.builtin import build_builtin_model
    from gdnserve.models.loader import load_model
    from gdnserve.models.tokenizer import load_tokenizer

    if args.max_tokens < 1:
        print("gdnserve generate: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        check_model_folder(args.model)
        check_device(args.device)
    except PreflightError as e:
        print(f"gdnserve generate: {e}", file=sys.stderr)
        return 2
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.tensor_parallel_size != 1:
        return _generate_tp(args, device, dtype)
    if args.model is None:
        model = build_builtin_model(dtype=dtype, device=device)
    else:
        model, _ = load_model(args.model, dtype=dtype, device=device)
    tok = load_tokenizer(args.model)
    ids = tok.encode(args.prompt)
    if not ids:
        print("gdnserve generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    cfg = engine_config(args, max_num_seqs=1, num_slots=2, max_model_len=len(ids) + args.max_tokens,
                        num_pages=-(-(len(ids) + args.max_tokens) // 16) + 2)
    runner = ModelRunner(model, cfg.runner_config())
    seq = runner.new_seq()
    t0 = time.perf_counter()
    logits = runner.step([PrefillItem(seq, ids)], [])
    out: list[int] = []
    eos = set(tok.eos_token_ids)
    for _ in range(args.max_tokens):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        logits = runner.step([], [(seq, nxt)])
    dt = time.perf_counter() - t0
    print(tok.decode(out))
    print(f"[{len(ids)} prompt + {len(out)} generated tokens in {dt * 1e3:.0f} ms on {device}, {dtype}; "
          f"{'embedded model' if args.model is None else args.model}]", file=sys.stderr)
    return 0


def _generate_tp(args: argparse.Namespace, device, dtype) -> int:
    """The same greedy continuation through the engine over ``--tensor-parallel-size`` ranks (worker processes)."""
    from gdnserve.engine.engine_api import EngineDeadError
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.entrypoints.llm import LLM
    from gdnserve.entrypoints.serve import engine_config
    try:
        cfg = engine_config(args, max_num_seqs=1, num_pages=256,
                            max_model_len=max(64, len(args.prompt.encode()) * 4 + args.max_tokens))
        llm = LLM(args.model, device=str(device), dtype=str(dtype).removeprefix("torch."), config=cfg)
    except (ValueError, EngineDeadError) as e:
        print(f"gdnserve generate: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    try:
        t0 = time.perf_counter()
        out = llm.generate(args.prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
        dt = time.perf_counter() - t0
    except EngineDeadError as e:
        print(f"gdnserve generate: {e}", file=sys.stderr)
        return 1
    finally:
        llm.close()
    print(out.outputs[0].text)
    print(f"[{len(out.prompt_token_ids)} prompt + {len(out.outputs[0].token_ids)} generated tokens in "
          f"{dt * 1e3:.0f} ms on {args.tensor_parallel_size} x {device.type}, {dtype}; "
          f"{'embedded model' if args.model is None else args.model}]", file=sys.stderr)
    return 0
