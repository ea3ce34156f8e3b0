"""The Ray Serve application: an ingress deployment running the OpenAI-compatible app of one server
(``entrypoints.server.build_app``, over a ``RemoteEngineClient``) and an engine deployment of N replicas behind
the checkpoint-affinity router.

``gdnserve serve --replicas N`` builds it with :func:`make_app`. On a cluster of your own, the builder
:func:`build_app` takes string arguments (``serve run gdnserve.replicas.app:build_app replicas=4 model=/ckpt
num_gpus=1``, or a Serve config file's ``import_path`` + ``args``): see ``docs/serving.md``.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from gdnserve.engine.config import EngineConfig
from gdnserve.entrypoints.config import ServerConfig
from gdnserve.replicas.engine_replica import EngineReplica, ReplicaSpec

ROUTERS = {"affinity": "gdnserve.replicas.router:CheckpointAffinityRouter",
           "default": "gdnserve.replicas.router:DefaultRouter"}
ENGINE_DEPLOYMENT = "GdnEngine"


@serve.ingress()
class Ingress:
    """One per application is enough (it tokenizes and formats; the engines do the work); more scale out."""

    async def __init__(self, engine: Any, spec: ReplicaSpec, server: ServerConfig, app_name: str) -> None:
        from gdnserve.models.tokenizer import load_tokenizer
        from gdnserve.replicas.client import RemoteEngineClient
        info = await engine.info.remote()     # waits for a replica; creates this process's router
        self.client = RemoteEngineClient(engine, load_tokenizer(spec.model), info["model_name"],
                                         info["max_model_len"], app_name=app_name, deployment=ENGINE_DEPLOYMENT)
        self.server = server

    def __serve_build_asgi_app__(self) -> Any:
        from gdnserve.entrypoints.server import build_app as build_http_app
        from gdnserve.replicas.metrics import ReplicaCollector
        app = build_http_app(self.client, config=self.server)
        app.state.server.metrics.registry.register(ReplicaCollector(self.client))
        return app


def engine_deployment(replicas: int, spec: ReplicaSpec, *, router: str = "affinity", num_cpus: float = 1.0,
                      num_gpus: float = 0.0, max_ongoing_requests: int | None = None,
                      stats_period_s: float = 1.0) -> Any:
    """The engine deployment (unbound). ``max_ongoing_requests``: per replica (default: the engine's
    ``max_num_seqs`` x 4, so that requests wait in the engine's queue, where checkpoints pair them, rather than
    in Serve's)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    return serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing_requests or 4 * spec.engine.max_num_seqs,
        max_queued_requests=-1, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_routing_stats_period_s=stats_period_s,
                                                  request_routing_stats_timeout_s=max(10.0, 5 * stats_period_s)),
        health_check_period_s=2.0, health_check_timeout_s=30.0)


def make_app(replicas: int, spec: ReplicaSpec, server: ServerConfig, *, app_name: str = "gdnserve",
             **engine_options: Any) -> Any:
    """The bound application: the ingress over ``engine_deployment(replicas, spec, **engine_options)``.
    ``app_name`` must be the name it is deployed under (the ingress finds its routers by it)."""
    engine = engine_deployment(replicas, spec, **engine_options)
    ingress = serve.deployment(Ingress, name="GdnIngress").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(spec), spec, server, app_name)


def _flag(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


_ENGINE_INTS = ("max_num_seqs", "max_model_len", "num_pages", "max_step_tokens", "spec_k")


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder (``import_path: gdnserve.replicas.app:build_app``). Arguments (strings
    from ``serve run`` / a config file, or typed values): ``replicas`` (2), ``router`` (affinity | default),
    ``model`` (an HF folder on every node; default the embedded model), ``device`` (auto), ``dtype``,
    ``num_cpus`` (1) / ``num_gpus`` (0) per replica, ``torch_threads``, ``max_ongoing_requests``,
    ``stats_period_s`` (1), ``app_name`` (gdnserve: the name you deploy it under), engine fields
    (``max_num_seqs``, ``max_model_len``, ``num_pages``, ``max_step_tokens``, ``spec_k``, ``prefill_mode``,
    ``auto_checkpoints``), and
    access: ``api_key``, ``public_metrics``, ``host`` (the address the proxy binds, for the Host check;
    default 0.0.0.0: no check), ``allowed_origins`` (comma-separated)."""
    a = dict(args)
    known = {"replicas", "router", "model", "device", "dtype", "num_cpus", "num_gpus", "torch_threads",
             "max_ongoing_requests", "stats_period_s", "app_name", "prefill_mode", "api_key", "public_metrics",
             "host", "allowed_origins", "auto_checkpoints", *_ENGINE_INTS}
    bad = sorted(set(a) - known)
    if bad:
        raise ValueError(f"unknown argument(s) {bad} for gdnserve.replicas.app:build_app; known: {sorted(known)}")
    model = a.get("model") or None
    eng = {k: int(a[k]) for k in _ENGINE_INTS if k in a}
    if "prefill_mode" in a:
        eng["prefill_mode"] = a["prefill_mode"]
    if "auto_checkpoints" in a:
        eng["auto_checkpoints"] = _flag(a["auto_checkpoints"])
    spec = ReplicaSpec(model=model, device=a.get("device", "auto"), dtype=a.get("dtype") or None,
                       engine=EngineConfig(model_name=model or "gdnserve-embedded", **eng),
                       torch_threads=int(a["torch_threads"]) if a.get("torch_threads") else None)
    origins = tuple(o.strip() for o in str(a.get("allowed_origins", "")).split(",") if o.strip())
    server = ServerConfig(api_key=a.get("api_key") or None, host=a.get("host", "0.0.0.0"),
                          public_metrics=_flag(a.get("public_metrics", False)), allowed_origins=origins)
    return make_app(int(a.get("replicas", 2)), spec, server, router=a.get("router", "affinity"),
                    app_name=a.get("app_name", "gdnserve"), num_cpus=float(a.get("num_cpus", 1)),
                    num_gpus=float(a.get("num_gpus", 0)),
                    max_ongoing_requests=int(a["max_ongoing_requests"]) if a.get("max_ongoing_requests") else None,
                    stats_period_s=float(a.get("stats_period_s", 1.0)))
