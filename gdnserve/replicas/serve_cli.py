"""``gdnserve serve --replicas N``: the same server flags, N engine replicas on a local Ray (or ``--ray-address``)
behind the checkpoint-affinity router, the OpenAI-compatible app on ``--host:--port`` (Ray Serve's proxy binds
it). Ray (the ``[replicas]`` extra), the model folder, the device and the port are checked before Ray starts (exit 2,
one line). Ray is imported only here, when the flag is given: without it ``gdnserve serve`` runs one engine
in-process as before."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; docs/serving.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="N engine replicas on Ray Serve behind a checkpoint-affinity router (default: one engine "
                        "in this process, no Ray)")
    g.add_argument("--router", default="affinity", choices=["affinity", "default"],
                   help="with --replicas: affinity (a request goes where its checkpoint is, else the less loaded of "
                        "two) or default (Ray Serve's power of two choices)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs per replica (default 1)")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="with --replicas: GPUs per replica (default 1 on CUDA, 0 on CPU)")
    g.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (e.g. auto) instead of starting a local one")


def shared_gpu_config(engine, gpus: float, device_bytes: int | None):
    """Replicas that share a GPU (``--replica-gpus`` < 1): each gets a fixed budget, its share ``gpus`` of
    ``--gpu-memory-utilization`` x the device's memory (``memory_budget_gb``, checked against the memory free when
    it starts). Each planning ``utilization x`` the whole device minus what is in use would count the replicas
    started before it as in use, and the first ones would take the device. A given ``--memory-budget-gb`` is kept
    (the user's split); ``device_bytes`` None (no CUDA device here to size it) is refused."""
    if engine.memory_budget_gb is not None:
        return engine
    if device_bytes is None:
        raise ValueError(f"--replica-gpus {gpus:g} shares a GPU between replicas: give each its "
                         "--memory-budget-gb (no CUDA device here to size the share of --gpu-memory-utilization)")
    share = engine.gpu_memory_utilization * gpus * device_bytes / (1 << 30)
    return engine.with_(memory_budget_gb=math.floor(share * 100) / 100)     # GiB, rounded down


def _fail(message: str, code: int = 2) -> int:
    print(f"gdnserve serve: {message}", file=sys.stderr, flush=True)
    return code


def run_replicas(args: argparse.Namespace) -> int:
    from gdnserve.entrypoints.preflight import PreflightError, bind_socket, check_device, check_model_folder
    from gdnserve.entrypoints.serve import engine_config, server_config
    if args.replicas < 1:
        return _fail(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus <= 0:
        return _fail(f"--replica-cpus must be > 0, got {args.replica_cpus}")
    try:
        import ray
        from ray import serve
    except ImportError as e:     # an optional dependency: name the extra that brings it, not a traceback
        return _fail(f"--replicas needs Ray Serve, which cannot be imported ({e}); install the replicas extra: "
                     "pip install \"gdnserve[replicas]\"")
    try:
        config = server_config(args)
        engine = engine_config(args)
    except ValueError as e:
        return _fail(str(e))
    try:
        check_model_folder(args.model)
        check_device(args.device)
        bind_socket(args.host, args.port).close()    # free now; Ray's proxy binds it
    except PreflightError as e:
        return _fail(str(e))
    import torch
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    gpus = args.replica_gpus if args.replica_gpus is not None else (1.0 if cuda else 0.0)
    if cuda and 0 < gpus < 1:
        try:
            engine = shared_gpu_config(engine, gpus, torch.cuda.get_device_properties(0).total_memory
                                       if torch.cuda.is_available() else None)
        except ValueError as e:
            return _fail(str(e))
    from gdnserve.replicas.app import make_app
    from gdnserve.replicas.engine_replica import ReplicaSpec
    env = {k: os.environ[k] for k in ("TRITON_INTERPRET",) if k in os.environ}
    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env={"env_vars": env} if env else None)
    else:   # logical CPUs: the replicas' (the proxy, the controller and the ingress take none)
        ray.init(num_cpus=math.ceil(args.replicas * args.replica_cpus), include_dashboard=False,
                 runtime_env={"env_vars": env} if env else None)
    stop = threading.Event()      # set by SIGINT / SIGTERM, also one that comes while the app is deployed
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        spec = ReplicaSpec(model=args.model, device="cuda" if cuda else args.device, dtype=args.dtype, engine=engine,
                           torch_threads=max(1, int(args.replica_cpus)) if not cuda else None)
        serve.run(make_app(args.replicas, spec, config, router=args.router, num_cpus=args.replica_cpus,
                           num_gpus=gpus), name="gdnserve", route_prefix="/")
        host = f"[{args.host}]" if ":" in args.host else args.host
        budget = f" ({engine.memory_budget_gb:g} GiB)" if engine.memory_budget_gb is not None else ""
        print(f"gdnserve: {args.replicas} replica(s) of {engine.model_name} on Ray Serve, router {args.router}, "
              f"{args.replica_cpus:g} CPU / {gpus:g} GPU{budget} each; API key "
              f"{'required' if config.api_key else 'none'}\n"
              f"  listening on http://{host}:{args.port}  (OpenAI base_url http://{host}:{args.port}/v1; "
              f"Ctrl-C stops)", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
