"""Causal depthwise conv1d over a slot-indexed conv pool ``[S, W-1, D]`` (raw inputs, oldest first).

- ``prefill.py``: packed varlen prefill (src/dst slots, same-call parents).
- ``update.py``: decode (1 token/request), verify (K+1 tokens/request, pending drafted inputs) and fold.
- ``naive.py``: float64 token-by-token references.
"""
from gdnserve.ops.conv.prefill import causal_conv1d_prefill
from gdnserve.ops.conv.update import causal_conv1d_fold, causal_conv1d_update

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "causal_conv1d_fold"]
