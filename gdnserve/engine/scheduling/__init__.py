"""What runs in each step, and what a finished step changes: requests and score jobs (``request``, ``intake``),
admission under the pools' budget (``admission``), the scheduler that owns a step's life cycle (``scheduler``:
``schedule() -> StepBatch``, ``update_from_output``), the step's data (``step_batch``), one request's failure
domain (``isolation``) and the counters (``engine_stats``). Imports ``cache`` (pools, checkpoints, sequences),
never ``execution``: the runner is handed a StepBatch as data."""
