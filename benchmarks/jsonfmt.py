"""Result JSON as people diff it: one row per line. ``json.dumps(indent=1)`` puts every scalar of every row on
its own line, which made the committed results most of the repository's lines; here a row (a list or object
whose members are scalars or lists / objects of scalars) stays on one line, and only deeper containers are broken
up."""
from __future__ import annotations

import json
from typing import Any

_SCALAR = (str, int, float, bool, type(None))


def dumps(obj: Any, default: Any = str, indent: int = 1) -> str:
    """``obj`` as JSON text (a trailing newline included); ``json.loads`` gives back what ``json.dumps`` would."""
    return _fmt(json.loads(json.dumps(obj, default=default)), 0, indent) + "\n"


def _fmt(x: Any, level: int, indent: int) -> str:
    flat = json.dumps(x, ensure_ascii=False)
    if _depth(x) <= 2:
        return flat
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(x, dict):
        body = ",\n".join(f"{inner}{json.dumps(k, ensure_ascii=False)}: {_fmt(v, level + 1, indent)}" for k, v in x.items())
        return "{\n" + body + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _fmt(v, level + 1, indent) for v in x) + "\n" + pad + "]"


def _depth(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max(map(_depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(_depth, x), default=0)
    return 0
