"""Sizing the pools before anything is allocated: ``memory_plan`` (pure arithmetic: demand vs budget) and
``memory_budget`` (the device's and the host's numbers, the weights, a profiled peak)."""
