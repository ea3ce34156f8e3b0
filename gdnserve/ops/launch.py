"""A lean Triton launch path shared by every launcher.

Triton's per-call binder inspects and specialises every argument (~0.2 µs each, plus dispatch:
~20–30 µs for our 25–45-argument kernels), which is most of a small step's host time. ``launch``
keys a cache of compiled kernels on exactly what Triton specialises on — constexpr values, tensor
dtypes and 16-byte alignment, None-ness, integers equal to 1 / divisible by 16 / wider than 32 bits
(only the width for ``do_not_specialize`` parameters), the device — and launches the cached kernel
directly. The first call of a key, Triton's CPU interpreter and launches with profiler hooks take the
ordinary jit call, so behaviour is Triton's own.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:  # the direct path relies on Triton >= 3.4 internals; older versions always take the jit call
    from triton import knobs
except ImportError:  # pragma: no cover
    knobs = None

_compiled: dict[tuple, Any] = {}


def pow2(x: int) -> int:
    """Next power of two >= x (plain ints: triton.next_power_of_2 / cdiv cost ~3 µs of host time each)."""
    return 1 << max(x - 1, 0).bit_length()


def cdiv(x: int, y: int) -> int:
    return -(-x // y)
_param_kinds: dict[int, tuple[str, ...]] = {}


def _kinds(fn: JITFunction) -> tuple[str, ...]:
    kinds = _param_kinds.get(id(fn))
    if kinds is None:
        kinds = tuple("c" if p.is_constexpr else ("n" if p.do_not_specialize else "s") for p in fn.params)
        _param_kinds[id(fn)] = kinds
    return kinds


def _spec(kind: str, a: Any) -> Any:
    if kind == "c":
        return a
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        wide = not -(1 << 31) <= a < (1 << 31)
        return ("i", wide) if kind == "n" else ("i", wide, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return "f"
    return a


def _hooked(hook: Any) -> bool:
    return bool(getattr(hook, "calls", hook))  # Triton 3.6: a HookChain, empty unless a profiler is on


def launch(fn: Any, grid: Sequence[int], args: Sequence[Any], num_warps: int, num_stages: int | None = None,
           key: tuple | None = None) -> Any:
    """Launch ``fn`` (a @triton.jit kernel) on ``grid`` with all its parameters positionally
    (constexprs included, in declaration order). ``key``: a caller-built cache key that captures the
    same specialisation more cheaply (it must start with something unique to ``fn``). Returns the
    compiled kernel (None under the interpreter or on old Triton)."""
    g = (tuple(grid) + (1, 1))[:3]
    opts = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if knobs is None or not isinstance(fn, JITFunction):       # interpreter / old Triton
        fn[g](*args, **opts)
        return None
    dev = torch.cuda.current_device()
    if key is None:
        key = (id(fn), dev, num_warps, num_stages, *map(_spec, _kinds(fn), args))
    else:
        key = (id(fn), dev, num_warps, num_stages, *key)
    kern = _compiled.get(key)
    if kern is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        kern = _compiled[key] = fn[g](*args, **opts)
        return kern
    stream = driver.active.get_current_stream(dev)
    kern.run(g[0], g[1], g[2], stream, kern.function, kern.packed_metadata, None, None, None, *args)
    return kern


class Prepared:
    """One kernel launch prepared once per step shape: kernel, grid, constexprs, strides and every argument
    bound at construction (the caller validates there), so a call costs one launch of the compiled kernel
    (a stream query and Triton's argument packing, no key, no checks).

    ``per_call``: positions in ``args`` of tensors a call may replace, in call order (``p(x, y)`` binds
    ``args[per_call[0]] = x`` ...). The caller promises they have the bound tensors' shapes, strides and
    dtypes; their 16-byte alignment is checked per call (it is part of Triton's specialisation) and a
    mismatch takes the ordinary ``launch`` path. Under the interpreter every call is the ordinary jit call."""

    __slots__ = ("fn", "grid", "args", "num_warps", "num_stages", "key", "per_call", "_align", "_kern", "_dev")

    def __init__(self, fn: Any, grid: Sequence[int], args: Sequence[Any], num_warps: int,
                 num_stages: int | None = None, key: tuple | None = None, per_call: Sequence[int] = ()):
        self.fn, self.grid, self.args = fn, (tuple(grid) + (1, 1))[:3], list(args)
        self.num_warps, self.num_stages, self.key, self.per_call = num_warps, num_stages, key, tuple(per_call)
        self._align = tuple(_aligned(self.args[i]) for i in self.per_call)
        self._kern = None
        self._dev = torch.cuda.current_device() if knobs is not None and isinstance(fn, JITFunction) else None

    def __call__(self, *tensors: Any) -> None:
        args = self.args
        for i, t in zip(self.per_call, tensors):
            args[i] = t
        kern = self._kern
        if (kern is None or (tensors and tuple(map(_aligned, tensors)) != self._align[:len(tensors)])
                or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            self._slow(tensors)
            return
        g = self.grid
        kern.run(g[0], g[1], g[2], driver.active.get_current_stream(self._dev), kern.function, kern.packed_metadata,
                 None, None, None, *args)

    def _slow(self, tensors: Sequence[Any]) -> None:
        """The ordinary launch (first call, profiler hooks, an alignment change): keyed by the full specialisation
        unless the binding is the prepared one."""
        same = tuple(map(_aligned, tensors)) == self._align[:len(tensors)]
        key = self.key if same else None
        kern = launch(self.fn, self.grid, self.args, self.num_warps, self.num_stages, key=key)
        if same and self._dev is not None:
            self._kern = kern


def _aligned(t: Any) -> bool:
    return t is None or t.data_ptr() % 16 == 0
