"""Gated delta rule over a slot-indexed SSM state pool ``[S, HV, V, K]`` (V-major, K contiguous).

- ``chunk.py``: chunked prefill (varlen, src/dst slots, same-call parents).
- ``recurrent.py``: decode (1 token/request) and verify (K+1 tokens/request, intermediate or replay).
- ``naive.py``: float64 token-by-token references.
"""
