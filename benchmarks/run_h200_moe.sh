#!/usr/bin/env bash
# One device call: GPU tests of the Triton routed experts and of captured MoE steps, then the MoE op
# benchmark. Results come back packed in one tar.   device run: carry [".whl"], command: bash benchmarks/run_h200_moe.sh
set -u
source benchmarks/device_env.sh res
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t() { timeout "$2" python3 -m pytest -q "${@:3}" "$1" > "$OUT/gpu_tests_$(basename $1 .py).log" 2>&1; echo "$1 rc=$?: $(tail -1 "$OUT/gpu_tests_$(basename $1 .py).log")"; }
t tests/ops/test_moe_experts.py 150
pack
timeout 200 python3 -m benchmarks.bench_moe --out $OUT > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
grep "^|" $OUT/moe_*.md
pack
t tests/engine/test_cuda_graphs_gpu.py 200
grep -E "passed|failed|Error" $OUT/gpu_tests_test_cuda_graphs_gpu.log | tail -5
pack
