"""Tensor parallelism: ``tp_check`` (does N fit the model and the GPUs), ``tp_workers`` (one process per extra
rank), ``tp_runner`` (rank 0's runner that drives them) and ``tp_launch`` (an LLMEngine over them)."""
