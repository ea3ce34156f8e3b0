"""Temporary config fields on top of an op family's per-GPU row (``chunk_configs.override``,
``fp8_linear.override``): tests and benchmarks that time a variant end to end set fields for every call in a
``with`` block instead of flipping a module global."""
from __future__ import annotations

import contextlib
import dataclasses


@contextlib.contextmanager
def override_fields(cls: type, store: dict[str, object], fields: dict[str, object]):
    """Put ``fields`` (names of the dataclass ``cls``) into ``store`` for the block, then restore it;
    ValueError naming the unknown fields."""
    bad = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if bad:
        raise ValueError(f"override: unknown {cls.__name__} fields {sorted(bad)}")
    old = dict(store)
    store.update(fields)
    try:
        yield
    finally:
        store.clear()
        store.update(old)
