"""One gdnserve engine as a Ray Serve replica: an ``AsyncEngine`` over the embedded model or an HF checkpoint,
called by the ingress through a deployment handle. Every output travels with the replica's unique id, so the
caller knows where a published checkpoint now lives. ``record_routing_stats`` is Serve's hook: what the
router reads about this replica (READY / PENDING checkpoint keys, READY lengths — the host and disk tiers'
checkpoints included as READY: a lookup restores them —, queue depth, running requests, and the engine's
``stats()`` for ``/metrics``)."""
from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import GenerateRequest, RequestOutput, ScoreResult


@dataclass(frozen=True)
class ReplicaSpec:
    """How each replica builds its engine. ``torch_threads``: CPU threads for torch in the replica (set it to
    the replica's CPUs, so replicas on one machine do not oversubscribe it)."""
    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model_name="gdnserve-embedded"))
    torch_threads: int | None = None


class EngineReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from gdnserve.engine.async_engine import AsyncEngine
        from gdnserve.entrypoints.llm import load_engine
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.engine = AsyncEngine(load_engine(spec.model, dtype=spec.dtype, device=spec.device, config=spec.engine))
        try:
            from ray import serve
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001  outside Serve (unit tests): the process id names it
            self.replica_id = f"pid{os.getpid()}"

    async def generate(self, req: GenerateRequest, route: Any = None) -> AsyncIterator[tuple[str, RequestOutput]]:
        """The engine's outputs of ``req`` (``route`` is the router's, unused here). Cancelled by the caller
        (its client went away, or it stopped reading): the engine request is aborted."""
        async for out in self.engine.generate(req):
            yield self.replica_id, out

    async def score(self, prefix: list[int], candidates: list[list[int]], label_token_ids: list[int] | None = None,
                    route: Any = None) -> tuple[str, ScoreResult]:
        return self.replica_id, await self.engine.score(prefix, candidates, label_token_ids)

    async def info(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "model_name": self.engine.model_name,
                "max_model_len": self.engine.max_model_len, "pid": os.getpid()}

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def record_routing_stats(self) -> dict[str, Any]:
        ready, pending, lengths = self.engine.checkpoint_keys()
        st = self.engine.stats()
        return {"replica": self.replica_id, "ready": ready, "pending": pending, "lengths": lengths,
                "queue_depth": st.get("queue_depth", 0), "running": st.get("running", 0), "engine": st}

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine thread of this replica has stopped")

    def crash(self) -> None:
        """Ends this replica's process at once (fault tests and drills): its in-flight requests are lost."""
        os._exit(1)
