"""``gdnserve score PREFIX CANDIDATE...``: score candidates after one prefix on the command line, the way
``/v1/score`` does (the prefix computed once, every candidate continued from its checkpoint in one step).
Prints one row per candidate: tokens, summed and mean log-probability, and with ``--labels`` the
probability of each label token as the next token (``--softmax``: renormalised over the labels)."""
from __future__ import annotations

import argparse
import json
import sys


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", help="the shared prefix text")
    p.add_argument("candidates", nargs="+", metavar="CANDIDATE", help="candidate continuations (one or more)")
    p.add_argument("--model", default=None, help="HF checkpoint folder; default: the embedded tiny model")
    p.add_argument("--labels", default=None, metavar="ID[,ID...]",
                   help="label token ids: report each one's probability as the next token after each candidate")
    p.add_argument("--softmax", action="store_true", help="renormalise the label probabilities over the labels")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="special-token strings in the texts become control tokens (default: plain text)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available, else cpu), cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")


def _fail(message: str, code: int = 2) -> int:
    print(f"gdnserve score: {message}", file=sys.stderr)
    return code


def run_score(args: argparse.Namespace) -> int:
    from gdnserve.entrypoints.preflight import PreflightError, check_device, check_model_folder
    try:
        labels = None if args.labels is None else [int(x) for x in args.labels.split(",") if x.strip()]
    except ValueError:
        return _fail(f"--labels {args.labels}: give comma-separated token ids")
    if args.softmax and not labels:
        return _fail("--softmax needs --labels")
    try:
        check_model_folder(args.model)
        check_device(args.device)
    except PreflightError as e:
        return _fail(str(e))
    from gdnserve.entrypoints.llm import load_engine
    from gdnserve.entrypoints.serve import engine_config
    try:
        engine = load_engine(args.model, dtype=args.dtype, device=args.device,  # 2 * seqs + 2 slots >= 1 + candidates
                             config=engine_config(args, max_num_seqs=max(4, len(args.candidates)),
                                                  num_pages=256 + 2 * len(args.candidates)))
    except (OSError, ValueError) as e:
        return _fail(f"cannot load {'the embedded model' if args.model is None else args.model}: {e}", 1)
    tok, special = engine.tokenizer, args.parse_special_tokens
    prefix = tok.encode(args.prefix, special=special)
    cands = [tok.encode(c, special=special) for c in args.candidates]
    empty = [repr(c) for c, ids in zip([args.prefix, *args.candidates], [prefix, *cands]) if not ids]
    if empty:
        return _fail(f"{empty[0]} encodes to no tokens")
    if labels is not None and any(not 0 <= t < tok.vocab_size for t in labels):
        return _fail(f"--labels: token ids must be in [0, {tok.vocab_size})")
    try:
        res = engine.score(prefix, cands, labels)
    except ValueError as e:
        return _fail(str(e))
    rows = []
    for text, c in zip(args.candidates, res.candidates):
        probs = None
        if labels is not None and c.label_probs is not None:
            probs = [c.label_probs.get(t, 0.0) for t in labels]
            total = sum(probs)
            if args.softmax:
                probs = [p / total for p in probs] if total > 0 else [1 / len(probs)] * len(probs)
        rows.append({"candidate": text, "num_tokens": c.num_tokens, "sum_logprob": c.sum_logprob,
                     "mean_logprob": c.mean_logprob,
                     "label_probs": None if probs is None else dict(zip(map(str, labels), probs))})
    if args.json:
        print(json.dumps({"prefix_tokens": len(prefix), "data": rows}, indent=2))
        return 0
    width = max(12, *(len(repr(r["candidate"])) for r in rows))
    head = f"{'candidate':<{width}}  tokens  sum_logprob  mean_logprob"
    head += "".join(f"  p({t})" for t in labels) if labels else ""
    print(f"prefix: {len(prefix)} tokens")
    print(head)
    for r in rows:
        line = f"{r['candidate']!r:<{width}}  {r['num_tokens']:>6}  {r['sum_logprob']:>11.4f}  {r['mean_logprob']:>12.4f}"
        if r["label_probs"] is not None:
            line += "".join(f"  {p:.4f}" for p in r["label_probs"].values())
        print(line)
    return 0
