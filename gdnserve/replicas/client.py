"""``RemoteEngineClient``: the ``AsyncEngineClient`` the ingress's OpenAI-compatible app (``build_app``, unchanged)
talks to, over the engine deployment's handle. Each call carries its ``Route`` (``keys.py``) for the router.

Faults: a replica that dies before a request has produced any output costs that request nothing: it is sent
again (the router no longer offers the dead replica; up to ``retries`` times). One that dies after outputs went
out fails the request with a ``ReplicaDiedError`` naming it (the server answers 500, or an error event on a
stream). A finished request that published a checkpoint (marker prefix or automatic) is told to the routers of
this process at once (``learn``), before the replica's next report.

``stats()`` merges the replicas' last reports (sums; the misses by reason summed too); ``replica_stats()``
gives them one by one, for ``/metrics``."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from gdnserve.engine.engine_api import GenerateRequest, RequestOutput, ScoreResult
from gdnserve.replicas.keys import Route, generate_route, published_key, score_route
from gdnserve.replicas.registry import routers_for


class ReplicaDiedError(RuntimeError):
    pass


def _cause(e: RayTaskError) -> BaseException:
    """The replica's own exception (a ValueError the server answers 400 with its message), not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


def merge_stats(reports: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for st in reports:
        for k, v in st.items():
            if isinstance(v, dict):
                d = out.setdefault(k, {})
                for kk, vv in v.items():
                    if isinstance(vv, (int, float)):
                        d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


class RemoteEngineClient:
    def __init__(self, handle: Any, tokenizer: Any, model_name: str, max_model_len: int, *, app_name: str,
                 deployment: str, retries: int = 2) -> None:
        self.handle, self.tokenizer = handle, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.app_name, self.deployment, self.retries = app_name, deployment, retries
        self.retried = 0    # requests sent again after their replica died before any output

    def _learn(self, replica: str, key: bytes, length: int) -> None:
        for r in routers_for(self.app_name, self.deployment):
            r.learn(replica, key, length)

    def _published(self, replica: str, req: GenerateRequest, route: Route, out: RequestOutput) -> None:
        if not out.checkpoint.published or not isinstance(req.prompt, list):
            return
        if route.exact is not None:           # its prefix (a producer's), and at its end, the automatic one
            self._learn(replica, route.exact, req.checkpoint_at)
        if len(out.outputs) == 1 and out.outputs[0].finish_reason in ("stop", "length"):
            self._learn(replica, *published_key(req.prompt, out.outputs[0].token_ids))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        ids = req.prompt if isinstance(req.prompt, list) else None
        route = generate_route(ids, req.checkpoint_at) if ids is not None else Route()
        for attempt in range(self.retries + 1):
            gen = self.handle.options(stream=True).generate.remote(req, route=route)
            sent = done = False
            try:
                async for replica, out in gen:
                    sent = True
                    if out.finished:
                        done = True
                        self._published(replica, req, route, out)
                    yield out
                return
            except RayTaskError as e:
                raise _cause(e) from None
            except RayActorError as e:
                if sent or attempt == self.retries:
                    raise ReplicaDiedError(f"the replica serving request {req.request_id} died after "
                                           f"{'streaming part of it' if sent else f'{attempt + 1} tries'}: "
                                           f"{type(e).__name__}") from None
                self.retried += 1
            finally:
                if not done:
                    gen.cancel()

    async def score(self, prefix: str | list[int], candidates: list[str | list[int]],
                    label_token_ids: list[int] | None = None) -> ScoreResult:
        route = score_route(prefix) if isinstance(prefix, list) else Route()
        for attempt in range(self.retries + 1):
            resp = self.handle.score.remote(prefix, candidates, label_token_ids, route=route)
            try:
                replica, result = await resp
                if route.exact is not None:
                    self._learn(replica, route.exact, len(prefix) - 1)
                return result
            except RayTaskError as e:
                raise _cause(e) from None
            except RayActorError as e:
                if attempt == self.retries:
                    raise ReplicaDiedError(f"the replica serving a score request died {attempt + 1} times: "
                                           f"{type(e).__name__}") from None
                self.retried += 1
            except BaseException:
                resp.cancel()
                raise
        raise AssertionError("unreachable")

    async def abort(self, request_id: str) -> None:
        """Nothing to do: leaving ``generate`` early cancels the replica's stream, which aborts the request there."""

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """unique replica id -> the engine stats of its last report."""
        routers = routers_for(self.app_name, self.deployment)
        if not routers:
            return {}
        return {rid: rep.get("engine", {}) for rid, rep in routers[0].replica_reports().items()}

    def stats(self) -> dict[str, Any]:
        return merge_stats(list(self.replica_stats().values()))
