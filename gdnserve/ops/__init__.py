"""Pure tensor ops over slot-indexed state pools. No engine knowledge lives here.

Families: ``conv/`` (causal depthwise conv1d with pooled history), ``gdn/`` (gated delta rule:
chunked prefill, recurrent decode / verify). Each family has a float64 ``naive.py`` reference,
a PyTorch path that runs on any device, and a Triton path used on CUDA.
"""
