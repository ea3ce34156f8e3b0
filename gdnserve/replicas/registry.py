"""The request routers of each engine deployment in this process (they live in the handles of the process
that calls the deployment: the ingress replica, or a driver). Its own module on purpose: Serve pickles the
router class's module by value, so state kept there would be a copy per unpickling."""
from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: dict[tuple[str, str], weakref.WeakSet] = {}


def register(app_name: str, deployment: str, router: Any) -> None:
    _ROUTERS.setdefault((app_name, deployment), weakref.WeakSet()).add(router)


def routers_for(app_name: str, deployment: str) -> list[Any]:
    return list(_ROUTERS.get((app_name, deployment), ()))
