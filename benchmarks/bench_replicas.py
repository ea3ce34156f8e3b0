"""Replicas on Ray Serve: queries per second and checkpoint hit rate of the checkpoint-affinity router vs Ray
Serve's default router (power of two choices), on the RFC workload shape of ``bench_serve.py``: groups of one
shared prefix + 1 producer and N consumers (distinct suffixes), every request marked at the end of its prefix
(``checkpoint_at``, what the server sends for a ``<|state_checkpoint|>`` marker), greedy, ``--max-tokens``
tokens each. All groups' requests are sent at once in random order through ``RemoteEngineClient`` (the
ingress's engine client; its handles run the routers); one replica is the reference row.

Run ``python -m benchmarks.bench_replicas --out benchmarks/results`` (options: --replicas, --groups, --consumers,
--prefix, --suffix, --max-tokens, --replica-cpus, --device, --quick). Writes ``replicas_<device>.md`` / ``.json``.

Per row: a warm-up pass of the same shape on other prompts, then ``--repeats`` timed passes (the same prompts
in every row). QPS = requests / wall time of a pass (median and range over the passes). Hit rate = consumers that started from a checkpoint (their provenance's ``hit_length``) / all
consumers; prefix computations = requests that computed their group's prefix (on one replica and with affinity
one per group; with the default router up to one per replica per group). The embedded model is tiny and random:
on CPU the prefix is most of the work, so the table shows what the recomputed prefixes cost.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from benchmarks import jsonfmt

ROWS = (("one replica", 1, "affinity"), ("default router", None, "default"), ("affinity router", None, "affinity"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--consumers", type=int, default=9, help="consumers per group (+1 producer; RFC: 9)")
    p.add_argument("--prefix", type=int, default=600, help="shared prefix tokens (RFC: 600)")
    p.add_argument("--suffix", default="16,32", help="suffix length range, inclusive (RFC: 16,32)")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request (default 1)")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="4 groups of 1 + 5, prefix 200 (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row, on different prompts (default 3)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_requests(args: argparse.Namespace, rng: random.Random, tag: str) -> list[Any]:
    from gdnserve.engine.engine_api import GenerateRequest
    from gdnserve.engine.sampling_params import SamplingParams
    lo, hi = (int(x) for x in args.suffix.split(","))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    reqs = []
    for g in range(args.groups):
        prefix = [rng.randrange(1, 200) for _ in range(args.prefix)]
        for c in range(args.consumers + 1):
            suffix = [rng.randrange(1, 200) for _ in range(rng.randint(lo, hi))]
            reqs.append(GenerateRequest(f"{tag}-g{g}-{c}", prefix + suffix, params, len(prefix)))
    rng.shuffle(reqs)
    return reqs


async def _one(client: Any, req: Any) -> tuple[list[int], int]:
    last = None
    async for out in client.generate(req):
        last = out
    return last.outputs[0].token_ids, last.checkpoint.hit_length


async def timed_pass(client: Any, reqs: list[Any]) -> tuple[float, list[tuple[list[int], int]]]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_one(client, r) for r in reqs))
    return time.perf_counter() - t0, res


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from gdnserve.engine.config import EngineConfig
    from gdnserve.models.tokenizer import load_tokenizer
    from gdnserve.replicas.app import ENGINE_DEPLOYMENT, engine_deployment
    from gdnserve.replicas.client import RemoteEngineClient
    from gdnserve.replicas.engine_replica import ReplicaSpec
    if args.quick:
        args.groups, args.consumers, args.prefix = 4, 5, 200
    engine = EngineConfig(model_name="gdnserve-embedded", max_num_seqs=64, num_pages=4096,
                          max_model_len=args.prefix + 64 + args.max_tokens)
    spec = ReplicaSpec(device=args.device, engine=engine,
                       torch_threads=max(1, int(args.replica_cpus)) if args.device == "cpu" else None)
    env = {k: os.environ[k] for k in ("TRITON_INTERPRET",) if k in os.environ}
    ray.init(num_cpus=int(args.replica_cpus * (2 * args.replicas + 1)), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env} if env else None)
    serve.start(http_options={"location": "NoServer"}, logging_config={"log_level": "WARNING"})
    tok = load_tokenizer(None)
    rows = []
    rng = random.Random(args.seed)
    try:
        for label, n, router in ROWS:
            n = n or args.replicas
            app = f"bench-{router}-{n}"
            serve.run(engine_deployment(n, spec, router=router, num_cpus=args.replica_cpus).bind(spec), name=app,
                      route_prefix=None)
            client = RemoteEngineClient(serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app), tok,
                                        engine.model_name, engine.max_model_len, app_name=app,
                                        deployment=ENGINE_DEPLOYMENT)
            warm_s, _ = asyncio.run(timed_pass(client, make_requests(args, rng, f"{app}-warm")))
            walls, res, n_req = [], [], 0
            for k in range(args.repeats):     # the same prompts in every row
                reqs = make_requests(args, random.Random(args.seed + 1 + k), app)
                wall, out = asyncio.run(timed_pass(client, reqs))
                walls.append(wall)
                res += out
                n_req = len(reqs)
            consumers = args.groups * args.consumers * args.repeats
            hits = sum(h > 0 for _, h in res)
            qps = sorted(n_req / w for w in walls)
            wall = sum(walls)
            rows.append({"row": label, "replicas": n, "router": router, "requests": n_req, "passes": args.repeats,
                         "wall_s": walls, "qps": qps[len(qps) // 2], "qps_min": qps[0], "qps_max": qps[-1],
                         "hits": hits, "hit_rate": hits / consumers,
                         "prefix_computations": (len(res) - hits) / args.repeats, "warmup_s": warm_s,
                         "tokens": [t for t, _ in res]})
            print(f"[bench_replicas] {label}: {rows[-1]['qps']:.2f} QPS, hit rate {hits / consumers:.2f}, "
                  f"{rows[-1]['prefix_computations']:.1f} prefix computations per pass ({wall:.1f} s)",
                  file=sys.stderr, flush=True)
            serve.delete(app)
    finally:
        serve.shutdown()
        ray.shutdown()
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    for r in rows:
        del r["tokens"]
    return {"rows": rows, "outputs_equal": same, "args": {k: str(v) for k, v in vars(args).items()}}


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    import ray
    lines = [f"# Replicas on Ray Serve: affinity vs default router ({args.device})", "",
             f"Commit {_git()}; `python -m benchmarks.bench_replicas --out {args.out}"
             f"{' --quick' if args.quick else ''}`; ray {ray.__version__}, python {platform.python_version()}, "
             f"{os.cpu_count()} CPU cores (shared); {args.replicas} replicas x {args.replica_cpus:g} CPU, embedded "
             "model (tiny, random weights).", "",
             f"Workload: {args.groups} groups x (1 producer + {args.consumers} consumers), prefix {args.prefix} "
             f"tokens, suffix {args.suffix.replace(',', '–')} tokens, every request marked at its prefix "
             f"(`checkpoint_at`), {args.max_tokens} greedy token(s) each; all requests at once, random order.", "",
             "| row | replicas | router | requests per pass | passes | QPS median [min–max] | consumer hit rate | "
             "prefix computations per pass |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['row']} | {r['replicas']} | {r['router']} | {r['requests']} | {r['passes']} | "
                     f"{r['qps']:.2f} [{r['qps_min']:.2f}–{r['qps_max']:.2f}] | {r['hit_rate']:.2f} | "
                     f"{r['prefix_computations']:.1f} |")
    lines += ["", f"Greedy outputs identical in every row: {result['outputs_equal']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"replicas_{'cpu' if args.device == 'cpu' else 'gpu'}"
    (args.out / f"{name}.json").write_text(jsonfmt.dumps(result))
    (args.out / f"{name}.md").write_text(report(result, args))
    print(report(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
