"""Attention over a paged KV cache ``[num_pages, page_size, KVH, Dh]`` per layer (architecture.md, "PagePool").

- ``paged.py``: ``store_kv`` (K/V of this step's tokens into page slots, -1 skips, one token may go to
  several slots), ``copy_pages`` (copy-on-write of whole pages) and ``paged_attention`` (varlen causal
  attention for prefill chunks and decode rows alike, read through per-sequence page tables, GQA).
- ``flash_triton.py``: the Triton attention kernel (GQA-packed tiles, two-phase causal loop, flash-decoding
  splits); ``paged_triton.py``: the Triton store_kv / copy_pages and the first (row-wise) attention kernel.
- ``naive.py``: the float64 reference on contiguous per-sequence K/V.

The pages themselves (refcounts, page tables, fork with a copy-on-write tail) live in
``gdnserve/engine/cache/page_pool.py``.
"""
from gdnserve.ops.attention.paged import copy_pages, paged_attention, store_kv

__all__ = ["store_kv", "copy_pages", "paged_attention"]
