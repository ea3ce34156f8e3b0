#!/usr/bin/env bash
# One device call: GPU tests of the Triton routed experts (alignment kernel included) and of captured MoE steps,
# the MoE op benchmark and tile sweep, then the model benchmark without the parity diagnosis.
#   device run: carry [".whl"], command: bash benchmarks/run_h200_moe.sh
set -u
source benchmarks/device_env.sh res7
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t() { timeout "$2" python3 -m pytest -q "${@:3}" "$1" > "$OUT/gpu_tests_$(basename $1 .py).log" 2>&1; echo "$1 rc=$?: $(tail -1 "$OUT/gpu_tests_$(basename $1 .py).log")"; }
t tests/ops/test_moe_experts.py 100
pack
timeout 60 python3 -m benchmarks.bench_moe --sweep --tokens 1,16,256 --experts 64 > "$OUT/moe_sweep.log" 2>&1; echo "sweep rc=$?"
cut -c1-300 $OUT/moe_sweep.log
timeout 120 python3 -m benchmarks.bench_moe --out $OUT --iters 10 > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
grep "^|" $OUT/moe_*.md
pack
timeout 170 python3 -m benchmarks.bench_model --out $OUT --time-budget 130 --diagnosis off > "$OUT/bench_model.log" 2>&1; echo "model rc=$?"
grep "^| decode\|^| prefill" $OUT/model_*.md
pack
t tests/engine/test_cuda_graphs_gpu.py 130
pack
