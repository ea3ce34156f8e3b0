#!/usr/bin/env bash
# One device call (issue 12): the serving benchmark (same workloads as benchmarks/results/serve_*; score jobs now
# scheduled like other requests) and the GPU engine tests that cover the runner paths the issue touched (CUDA-graph
# verify commit from the graph's own slot vector, MTP). device run: carry [".dev_wt12", ".whl"],
# command: cd .dev_wt12 && ln -sfn ../.whl .whl; bash benchmarks/run_h200_issue12.sh
set -u
source benchmarks/device_env.sh res12
timeout 160 python3 -m benchmarks.bench_serve --out $OUT --time-budget 110 > "$OUT/bench_serve.log" 2>&1; echo "serve rc=$?"
grep "^|\|Target" $OUT/serve_*.md | cut -c1-220
pack
timeout 80 python3 -m pytest -q tests/engine/test_cuda_graphs_gpu.py tests/engine/test_spec_mtp.py -x > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?: $(tail -1 $OUT/gpu_tests.log)"
grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -5
pack
